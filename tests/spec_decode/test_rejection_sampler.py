"""The rejection sampler: exact table cases, seeded determinism, and the output distribution.

The statistical tests check the paper's guarantee on a small vocabulary: whatever q the drafts come
from, the emitted tokens are distributed as the target's p (total-variation distance to p small after
tens of thousands of vectorized samples), and the one-draft-at-a-time reference oracle agrees.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.sample.rejection_sampler import RejectionSampler, rejection_sample_reference
from llmserve.sample.speculative import build_row_metadata, expand_rows
from llmserve.sample.verifier import DraftVerifier
from llmserve.sampling_params import SamplingParams
from llmserve.worker.request_state import CachedRequestState

V = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
RANDOM = SamplingParams(temperature=1.0, max_tokens=64)


def _request(
    index: int, params: SamplingParams, drafts: list[int], seed: int | None = None, prompt=(0, 1)
) -> CachedRequestState:
    """A request as the model runner holds it, verifying `drafts`."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    request = CachedRequestState(
        str(index), list(prompt), list(prompt), params, (), generator, [], len(prompt)
    )
    request.spec_token_ids = list(drafts)
    return request


def _run(requests: list[CachedRequestState], target_probs: list[torch.Tensor], draft_probs=None):
    """target_probs[i]: request i's [k_i + 1, V] p rows (zeros allowed: log(0) = -inf logits)."""
    num_drafts = [len(r.spec_token_ids) for r in requests]
    rows, drafts_before = expand_rows(requests, [k + 1 for k in num_drafts])
    metadata = build_row_metadata(rows, drafts_before, V, torch.device("cpu"))
    logits = torch.cat(target_probs).log()
    drafts = torch.tensor([t for r in requests for t in r.spec_token_ids], dtype=torch.int64)
    return RejectionSampler()(logits, num_drafts, drafts, draft_probs, metadata)


def _one_hot_rows(*tokens: int) -> torch.Tensor:
    """Rows of p that put all mass on one token each (the argmax, and the only possible sample)."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 0.9 + 0.1 / V


# -- table tests ------------------------------------------------------------------------------------


def test_greedy_perfect_match_accepts_all_and_adds_the_bonus():
    out = _run([_request(0, GREEDY, [3, 5, 1])], [_one_hot_rows(3, 5, 1, 6)])
    assert out.num_accepted.tolist() == [3]
    assert out.next_token_ids.tolist() == [6]


def test_greedy_early_mismatch_yields_the_targets_token():
    out = _run([_request(0, GREEDY, [3, 4, 1])], [_one_hot_rows(3, 5, 1, 6)])
    assert out.num_accepted.tolist() == [1]
    assert out.next_token_ids.tolist() == [5]


def test_greedy_first_draft_rejected():
    out = _run([_request(0, GREEDY, [2, 5])], [_one_hot_rows(7, 5, 1)])
    assert out.num_accepted.tolist() == [0]
    assert out.next_token_ids.tolist() == [7]


def test_one_hot_q_accepts_a_certain_draft_and_never_an_impossible_one():
    """n-gram drafts (one-hot q): p(x) = 1 always accepts; p(x) = 0 always rejects, and the recovered
    token comes from p without x."""
    certain = torch.zeros(3, V)
    certain[0, 4] = certain[1, 2] = 1.0
    certain[2] = 1.0 / V
    impossible = torch.zeros(2, V)
    impossible[0, 1] = impossible[0, 6] = 0.5  # draft 3 has p = 0: rejected, recovered from {1, 6}
    impossible[1] = 1.0 / V
    for seed in range(20):
        requests = [_request(0, RANDOM, [4, 2], seed), _request(1, RANDOM, [3], seed + 100)]
        out = _run(requests, [certain, impossible])
        assert out.num_accepted.tolist() == [2, 0]
        assert out.next_token_ids[1].item() in (1, 6)


def test_mixed_batch_greedy_random_and_no_drafts():
    """Rows are laid out per request (k_i + 1 each); a request without drafts gets a plain sample."""
    plain = torch.zeros(1, V)
    plain[0, 5] = 1.0
    sampled = torch.zeros(3, V)
    sampled[0, 2] = sampled[1, 3] = sampled[2, 0] = 1.0
    requests = [
        _request(0, GREEDY, [3, 4, 1]),  # mismatch at the second draft
        _request(1, RANDOM, [], seed=1),  # no drafts: its single row is the bonus row
        _request(2, RANDOM, [2, 3], seed=2),  # one-hot q, both certain: bonus from the last row
        _request(3, GREEDY, []),
    ]
    out = _run(requests, [_one_hot_rows(3, 5, 1, 6), plain, sampled, _one_hot_rows(7)])
    assert out.num_accepted.tolist() == [1, 0, 2, 0]
    assert out.next_token_ids.tolist() == [5, 5, 0, 7]


def test_draft_probs_zero_overlap_always_rejects_and_recovers_from_p():
    """q puts all mass where p has none: every draft is rejected and the recovered token is p's."""
    p = torch.zeros(2, V)
    p[0, :4] = 0.25
    p[1] = 1.0 / V
    q = torch.zeros(1, V)
    q[0, 4:] = 0.25
    for seed in range(20):
        out = _run([_request(0, RANDOM, [5], seed)], [p], draft_probs=q)
        assert out.num_accepted.tolist() == [0]
        assert out.next_token_ids.item() < 4


def test_seeded_requests_do_not_depend_on_the_batch():
    """A seeded request draws from its own generator: the same outcome alone or among others."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, V), dim=-1)
    q = torch.softmax(torch.randn(3, V), dim=-1)
    drafts = q.argmax(dim=-1).tolist()
    for seed in range(10):
        alone = _run([_request(0, RANDOM, drafts, seed)], [p], q)
        others = [_request(i, RANDOM, drafts, seed=1000 + i) for i in (1, 2)]
        batched = _run([others[0], _request(0, RANDOM, drafts, seed), others[1]], [p, p, p], q.repeat(3, 1))
        again = _run([_request(0, RANDOM, drafts, seed)], [p], q)
        outcome = (alone.num_accepted[0], alone.next_token_ids[0])
        assert outcome == (batched.num_accepted[1], batched.next_token_ids[1])
        assert outcome == (again.num_accepted[0], again.next_token_ids[0])


# -- the output distribution --------------------------------------------------------------------------

P = torch.tensor(
    [
        [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02],
        [0.02, 0.03, 0.05, 0.10, 0.10, 0.15, 0.25, 0.30],
        [0.10, 0.40, 0.05, 0.05, 0.20, 0.05, 0.05, 0.10],
    ]
)
Q = torch.tensor(
    [
        [0.02, 0.03, 0.05, 0.05, 0.10, 0.15, 0.20, 0.40],
        [0.40, 0.20, 0.15, 0.10, 0.05, 0.05, 0.03, 0.02],
    ]
)


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=V).double() / len(samples)
    return 0.5 * float((freq - p.double()).abs().sum())


def _tv_bound(p: torch.Tensor, n: int) -> float:
    """Three times the expected TV of n honest samples from p (sum of the bins' mean absolute errors)."""
    return 3 * 0.5 * float((2 * p * (1 - p) / (torch.pi * n)).sqrt().sum())


def _emitted(num_accepted: torch.Tensor, next_ids: torch.Tensor, drafts: torch.Tensor, position: int):
    """Tokens emitted at `position` by the requests that reached it (accepted drafts, then next_ids)."""
    reached = num_accepted >= position
    token = torch.where(num_accepted > position, drafts[:, min(position, drafts.shape[1] - 1)], next_ids)
    return token[reached]


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-q", "ngram-one-hot-q"])
def test_emitted_tokens_follow_the_target_distribution(one_hot):
    """20k requests verifying 2 drafts drawn from a q far from p (TV(p, q) > 0.4): the token at every
    position is distributed as that position's p, within sampling noise (0.02 for 20k samples)."""
    n, k = 20_000, 2
    torch.manual_seed(1234)
    drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True) for j in range(k)], dim=1)
    requests = [_request(i, RANDOM, drafts[i].tolist()) for i in range(n)]
    q = None if one_hot else Q.repeat(n, 1)
    out = _run(requests, [P] * n, q)
    # With one-hot q a draft x survives with probability p(x) (about 0.06 here), so both drafts are
    # accepted too rarely for the bonus position to be measured; draft-q covers it.
    for position in range(k if one_hot else k + 1):
        emitted = _emitted(out.num_accepted, out.next_token_ids, drafts, position)
        assert len(emitted) > 1000
        assert _tv(emitted, P[position]) < _tv_bound(P[position], len(emitted)), position
    assert 0.5 * float((P[:2] - Q).abs().sum(dim=1).min()) > 0.4


def test_reference_oracle_follows_the_target_distribution_and_agrees():
    """The paper's one-draft-at-a-time algorithm (the oracle) converges to p too, and its frequencies
    match the vectorized sampler's."""
    n = 4000
    generator = torch.Generator().manual_seed(7)
    first = []
    for _ in range(n):
        drafts = [int(torch.multinomial(Q[j], 1, generator=generator)) for j in range(2)]
        first.append(rejection_sample_reference(P, drafts, Q, greedy=False, generator=generator)[0])
    oracle = torch.tensor(first)
    assert _tv(oracle, P[0]) < _tv_bound(P[0], n)
    torch.manual_seed(7)
    drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True) for j in range(2)], dim=1)
    out = _run([_request(i, RANDOM, drafts[i].tolist()) for i in range(n)], [P] * n, Q.repeat(n, 1))
    vectorized = _emitted(out.num_accepted, out.next_token_ids, drafts, 0)
    freq = [torch.bincount(x, minlength=V).double() / len(x) for x in (oracle, vectorized)]
    assert 0.5 * float((freq[0] - freq[1]).abs().sum()) < 0.05


def test_reference_oracle_greedy_table():
    rows = _one_hot_rows(3, 5, 1, 6)
    assert rejection_sample_reference(rows, [3, 5, 1], None, greedy=True) == [3, 5, 1, 6]
    assert rejection_sample_reference(rows, [3, 4, 1], None, greedy=True) == [3, 5]


# -- the verifier's plain-greedy path --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_plain_greedy_verification_equals_the_rejection_sampler(seed):
    """Greedy requests without penalties skip the rejection sampler: same accepted drafts and tokens."""
    generator = torch.Generator().manual_seed(seed)
    num_drafts = [3, 0, 7, 1, 5]
    logits = torch.randn(sum(k + 1 for k in num_drafts), V, generator=generator).to(torch.bfloat16)
    argmax = logits.float().argmax(dim=-1).tolist()
    requests, row = [], 0
    for index, k in enumerate(num_drafts):
        # drafts that follow the target's argmax for a random stretch, then go wrong
        stop = int(torch.randint(0, k + 1, (), generator=generator))
        drafts = [argmax[row + j] if j < stop else (argmax[row + j] + 1) % V for j in range(k)]
        requests.append(_request(index, GREEDY, drafts))
        row += k + 1
    fast, logprobs = DraftVerifier(V, torch.device("cpu"))(logits, requests, {})
    full = _run(requests, [torch.softmax(logits.float(), dim=-1)])  # the rejection sampler, same argmax
    expected = {
        r.request_id: r.spec_token_ids[:a] + [t]
        for r, a, t in zip(requests, full.num_accepted.tolist(), full.next_token_ids.tolist(), strict=True)
    }
    assert fast == expected and logprobs == {}
    assert [len(fast[r.request_id]) - 1 for r in requests] != [0] * len(requests)  # some drafts accepted


def test_penalized_greedy_requests_take_the_full_path():
    """A repetition penalty changes the argmax, so the plain path must not serve it."""
    logits = torch.log(_one_hot_rows(3, 5))
    penalized = SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=100.0)
    request = _request(0, penalized, [3], prompt=[3])  # token 3 is in the prompt: its logit is penalized
    tokens, _ = DraftVerifier(V, torch.device("cpu"))(logits, [request], {})
    assert tokens["0"][0] != 3  # the plain argmax would have accepted 3


class _RaisesForRequestOne:
    """A logits processor (as a grammar mask is) that raises on the rows of request "1"."""

    def applies_to(self, params) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits, rows, params, output_token_ids) -> None:
        if any(1 in p.logit_bias for p in params):
            raise KeyError("injected processor fault")


def test_a_raising_logits_processor_fails_only_its_request_in_verification(monkeypatch):
    import llmserve.sample.logits_processors as processors

    monkeypatch.setattr(processors, "PROCESSORS", (*processors.PROCESSORS, _RaisesForRequestOne()))
    logits = torch.log(_one_hot_rows(3, 5, 2, 4, 6))  # rows: request 0 (3 drafts + 1), request 1 (0 + 1)
    requests = [
        _request(0, SamplingParams(temperature=0.0, max_tokens=64, logit_bias={7: 0.0}), [3, 5, 2]),
        _request(1, SamplingParams(temperature=0.0, max_tokens=64, logit_bias={1: 0.0}), []),
    ]
    verifier = DraftVerifier(V, torch.device("cpu"))
    with pytest.raises(KeyError):  # no caller to fail its request: the step fails
        verifier(logits, requests, {})
    failed: list[str] = []
    tokens, _ = verifier(logits, requests, {}, failed)
    assert failed == ["1"]
    assert tokens["0"] == [3, 5, 2, 4]  # every draft accepted, then the bonus token: unaffected
