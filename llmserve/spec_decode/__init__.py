"""Speculative decoding: cheap proposers guess the next k tokens, one target forward verifies them all.

See docs/speculative.md. Here: `proposer` (the one `Proposer` interface, called after each step's
sampling for the next step), `registry` (proposers by `--speculative-method`), `proposers/` (n-gram
prompt lookup, suffix decoding, draft and early-exit models, the draft head) and `head_training`.
Elsewhere, below this package: the settings (config/speculative.py), the scheduler's side
(core/draft_planner.py), the proposal a request carries (request.py: DraftProposal), verification
(sample/verifier.py, sample/rejection_sampler.py, sample/speculative.py) and the counters (outputs.py:
SpecDecodeStats).
"""
