"""Speculative decoding: cheap proposers guess the next k tokens, one target forward verifies them all.

See docs/speculative.md. Modules: `config` (SpeculativeConfig), `planner` (the scheduler's side: how
many drafts each request verifies; n-gram proposals), `proposers/` (n-gram prompt lookup, draft and
early-exit models), `rejection_sampler` (accept / recover / bonus), `verifier` (the model runner's
side), `sampling` (the sampler's processing per draft position) and `metrics`.
"""
