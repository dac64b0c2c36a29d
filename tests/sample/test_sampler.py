"""Sampler behaviour on small random vocabularies: exact where deterministic, statistical otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.sampler import Sampler, apply_penalties
from llmserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
sampler = Sampler()


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: list[tuple[int, ...]] | None = None,
) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(rows)],
        output_token_ids=outputs or [[] for _ in range(rows)],
        generators=generators or [None] * rows,
        eos_token_ids=eos or [() for _ in range(rows)],
        vocab_size=vocab,
        device=CPU,
    )


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=CPU).manual_seed(seed)


def repeat_rows(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Sample `draws` times from one row by batching it `draws` times (one sampler call)."""
    batch = logits.expand(draws, -1)
    return sampler(batch, build([params] * draws, logits.shape[-1])).sampled_token_ids


def frequencies(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(samples, minlength=vocab).float() / samples.numel()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def test_all_greedy_is_argmax_with_no_extra_work() -> None:
    logits = torch.randn(8, 64)
    metadata = build([SamplingParams(temperature=0.0)] * 8, 64)
    assert metadata.all_greedy and metadata.temperature is None and metadata.top_k is None
    assert metadata.top_p is None and metadata.min_p is None and metadata.output_token_counts is None
    out = sampler(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.sampled_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype_and_input_untouched(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 32).to(dtype)
    before = logits.clone()
    out = sampler(logits, build([SamplingParams(temperature=0.8, top_p=0.9, logprobs=2)] * 4, 32))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_top_k_one_equals_greedy(temperature: float) -> None:
    logits = torch.randn(16, 64)
    out = sampler(logits, build([SamplingParams(temperature=temperature, top_k=1)] * 16, 64))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def _draw_seeded_alone(logits_steps: list[torch.Tensor], params: SamplingParams, seed: int) -> list[int]:
    gen = generator(seed)
    return [
        int(sampler(step.unsqueeze(0), build([params], step.shape[-1], generators=[gen])).sampled_token_ids)
        for step in logits_steps
    ]


def _draw_seeded_in_batch(
    logits_steps: list[torch.Tensor], params: SamplingParams, seed: int, row: int
) -> list[int]:
    others = [
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, min_p=0.1, seed=7),
        SamplingParams(temperature=1.3, frequency_penalty=0.5),
    ] * 2
    params_batch = others[:row] + [params] + others[row:]
    gen = generator(seed)
    tokens = []
    for step in logits_steps:
        batch = torch.randn(len(params_batch), step.shape[-1])
        batch[row] = step
        generators = [generator(99) if p.seed is not None else None for p in params_batch]
        generators[row] = gen
        metadata = build(
            params_batch, step.shape[-1], outputs=[[1, 2]] * len(params_batch), generators=generators
        )
        tokens.append(int(sampler(batch, metadata).sampled_token_ids[row]))
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    steps = [torch.randn(50) for _ in range(12)]
    params = SamplingParams(temperature=1.0, seed=42)
    alone = _draw_seeded_alone(steps, params, seed=42)
    assert _draw_seeded_in_batch(steps, params, seed=42, row=5) == alone
    assert _draw_seeded_in_batch(steps, params, seed=42, row=0) == alone


def test_different_seeds_differ() -> None:
    steps = [torch.zeros(50) for _ in range(30)]  # uniform: 30 matching draws would be a 50**-30 event
    params = SamplingParams(temperature=1.0)
    first, second = _draw_seeded_alone(steps, params, 1), _draw_seeded_alone(steps, params, 2)
    assert first != second
    assert _draw_seeded_alone(steps, params, 1) == first


def test_top_k_never_leaves_the_top_k() -> None:
    logits = torch.randn(64)
    samples = repeat_rows(logits, SamplingParams(top_k=5), 2000)
    allowed = set(logits.topk(5).indices.tolist())
    assert set(samples.tolist()) == allowed


def test_top_k_per_row() -> None:
    logits = torch.randn(6, 40)
    ks = [1, 2, 3, 10, -1, 39]
    params = [SamplingParams(temperature=1.2, top_k=k) for k in ks]
    for _ in range(50):
        sampled = sampler(logits, build(params, 40)).sampled_token_ids
        for row, k in enumerate(ks):
            rank = int((logits[row] > logits[row, sampled[row]]).sum())
            assert k == -1 or rank < k


def _shuffled_log_probs(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with the given probabilities at shuffled positions, and the positions by rank."""
    order = torch.randperm(len(probs))
    logits = torch.empty(len(probs))
    logits[order] = torch.tensor(probs).log()
    return logits, order


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    # 5e-324 is 0 in float32 (a fuzzed request once failed the engine step with it)
    [(5e-324, 1), (1e-9, 1), (0.5, 2), (0.75, 3), (0.88, 4), (0.97, 6), (1.0, 8)],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, nucleus: int) -> None:
    probs = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01]
    logits, order = _shuffled_log_probs(probs)
    samples = repeat_rows(logits, SamplingParams(top_p=top_p), 2000)
    assert set(samples.tolist()) == set(order[:nucleus].tolist())


def test_top_p_with_top_k() -> None:
    logits, order = _shuffled_log_probs([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
    samples = repeat_rows(logits, SamplingParams(top_p=0.9, top_k=2), 2000)
    assert set(samples.tolist()) == set(order[:2].tolist())  # top-k first, then the nucleus of what is left


def test_top_p_rows_with_top_k_leave_other_rows_alone() -> None:
    logits, order = _shuffled_log_probs([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
    params = [SamplingParams(top_p=0.75, top_k=4), SamplingParams(top_k=6), SamplingParams()]
    metadata = build(params * 1000, 8)
    assert metadata.top_p_candidates == 4  # a topk(4) instead of a full sort
    samples = sampler(logits.expand(3000, -1), metadata).sampled_token_ids.view(1000, 3)
    for column, support in enumerate((3, 6, 8)):
        assert set(samples[:, column].tolist()) == set(order[:support].tolist())


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, 8), (0.3, 3), (0.5, 2), (1.0, 1)])
def test_min_p(min_p: float, kept: int) -> None:
    logits, order = _shuffled_log_probs([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
    samples = repeat_rows(logits, SamplingParams(min_p=min_p), 2000)
    assert set(samples.tolist()) == set(order[:kept].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_converge_to_tempered_softmax(temperature: float) -> None:
    logits = torch.randn(10) * 1.5
    samples = repeat_rows(logits, SamplingParams(temperature=temperature), 20_000)
    expected = torch.softmax(logits / temperature, dim=-1)
    total_variation = 0.5 * (frequencies(samples, 10) - expected).abs().sum()
    assert total_variation < 0.03


def test_temperature_scales_the_processed_distribution() -> None:
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=t, logprobs=10) for t in (0.5, 1.0, 2.0)]
    out = sampler(logits, build(params, 10))
    for row, t in enumerate((0.5, 1.0, 2.0)):
        expected = torch.log_softmax(logits[row] / t, dim=-1)
        torch.testing.assert_close(out.logprobs[row], expected[out.logprobs_token_ids[row]])


# Logits of a 6-token vocabulary; prompt [0, 1]; output [2, 2, 3].
PENALTY_LOGITS = [2.0, -1.0, 0.5, -0.5, 1.0, 3.0]
PENALTY_CASES = [
    (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, -1.0, 1.0, 3.0]),  # seen: 0, 1, 2, 3
    (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, -0.5, -1.0, 1.0, 3.0]),  # 2 twice, 3 once
    (SamplingParams(presence_penalty=0.5), [2.0, -1.0, 0.0, -1.0, 1.0, 3.0]),  # 2 and 3 once each
    (SamplingParams(frequency_penalty=-1.0, presence_penalty=1.0), [2.0, -1.0, 1.5, -0.5, 1.0, 3.0]),
    (SamplingParams(), PENALTY_LOGITS),
]


def test_penalties_match_hand_computed_values() -> None:
    params = [case[0] for case in PENALTY_CASES]
    rows = len(params)
    metadata = build(params, 6, prompts=[[0, 1]] * rows, outputs=[[2, 2, 3]] * rows)
    logits = torch.tensor([PENALTY_LOGITS] * rows)
    penalized = apply_penalties(logits, metadata)
    torch.testing.assert_close(penalized, torch.tensor([case[1] for case in PENALTY_CASES]))


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=4)
    out = sampler(logits, build([params], 4, prompts=[[1]], outputs=[[0]]))
    assert int(out.sampled_token_ids) == 2  # 3.0 / 1.5 = 2.0 < 2.5
    expected = torch.log_softmax(torch.tensor([0.0, 2.0, 2.5, 1.0]), dim=-1)
    torch.testing.assert_close(out.logprobs[0], expected.sort(descending=True).values)


def test_min_tokens_masks_eos_and_stop_ids_only_while_short() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]] * 3)  # eos 3 best, stop id 4 next, then 2
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    other = SamplingParams(temperature=0.0)
    eos = [(3,)] * 3
    short = sampler(logits, build([params, params, other], 5, outputs=[[1, 1], [], [1]], eos=eos))
    assert short.sampled_token_ids.tolist() == [2, 2, 3]
    long_enough = sampler(logits, build([params, other, params], 5, outputs=[[1, 1, 1]] * 3, eos=eos))
    assert long_enough.sampled_token_ids.tolist() == [3, 3, 3]


def test_min_tokens_ignores_out_of_vocab_stop_ids() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1000])
    out = sampler(torch.tensor([[0.0, 2.0, 1.0]]), build([params], 3, eos=[(1,)]))
    assert out.sampled_token_ids.tolist() == [2]


def test_logprobs_are_of_the_processed_distribution() -> None:
    logits = torch.randn(2, 40)
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=2),
    ]
    out = sampler(logits, build(params, 40))
    processed = logits[0] / 0.5
    processed[processed < processed.topk(3).values[-1]] = -math.inf
    expected = torch.log_softmax(processed, dim=-1)
    top = expected.topk(5)
    assert torch.equal(out.logprobs_token_ids[0, :3], top.indices[:3])
    torch.testing.assert_close(out.logprobs[0], top.values)
    assert torch.isinf(out.logprobs[0, 3:]).all()
    sampled = out.sampled_token_ids[0]
    torch.testing.assert_close(out.sampled_logprobs[0], expected[sampled])
    full = torch.log_softmax(logits[1], dim=-1)
    torch.testing.assert_close(out.logprobs[1], full.topk(5).values)
    torch.testing.assert_close(out.sampled_logprobs[1], full[out.sampled_token_ids[1]])


def test_greedy_rows_report_penalized_logprobs_at_temperature_one() -> None:
    logits = torch.randn(2, 30)
    params = [
        SamplingParams(temperature=0.0, top_k=2, presence_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.3, top_p=0.5, logprobs=3),
    ]
    out = sampler(logits, build(params, 30, outputs=[[4, 5], [4, 5]]))
    penalized = logits[0].clone()
    penalized[[4, 5]] -= 1.0
    expected = torch.log_softmax(penalized, dim=-1)
    assert int(out.sampled_token_ids[0]) == int(penalized.argmax())
    torch.testing.assert_close(out.logprobs[0], expected.topk(3).values)
    torch.testing.assert_close(out.sampled_logprobs[0], expected.max())


def test_logprobs_zero_still_reports_the_sampled_token() -> None:
    out = sampler(torch.randn(2, 16), build([SamplingParams(logprobs=0), SamplingParams()], 16))
    assert out.logprobs.shape == (2, 0)
    assert out.sampled_logprobs.shape == (2,)


def test_mixed_batch_of_greedy_sampled_and_seeded_rows() -> None:
    vocab = 48
    logits = torch.randn(6, vocab)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=4),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, seed=5),  # greedy: its seed is irrelevant
        SamplingParams(temperature=1.1, top_p=0.6, seed=11),
        SamplingParams(temperature=0.9, min_p=0.2),
    ]
    generators = [None, None, generator(3), generator(5), generator(11), None]
    metadata = build(params, vocab, generators=generators)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.seeded_rows == [2, 4] and metadata.has_unseeded_random
    sampled = sampler(logits, metadata).sampled_token_ids
    greedy = logits.argmax(dim=-1)
    assert sampled[0] == greedy[0] and sampled[3] == greedy[3]
    assert int(sampled[1]) in logits[1].topk(4).indices.tolist()
    for row, seed in ((2, 3), (4, 11)):
        alone = sampler(logits[row : row + 1], build([params[row]], vocab, generators=[generator(seed)]))
        assert sampled[row] == alone.sampled_token_ids[0]


def test_all_seeded_batch_skips_the_shared_draw() -> None:
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.0)]
    metadata = build(params, 20, generators=[generator(1), None])
    assert not metadata.has_unseeded_random
    logits = torch.randn(2, 20)
    state = torch.get_rng_state()
    sampler(logits, metadata)
    assert torch.equal(torch.get_rng_state(), state)
