"""KV admission arithmetic, checked against numbers worked out by hand."""

import pytest

from llmserve.benchmarks.memory import (
    LiveMeasurement,
    LiveSample,
    admit_in_order,
    contiguous_allocation,
    paged_allocation,
    simulate,
)
from llmserve.benchmarks.workload import BenchRequest


def toy(prompt_len: int, max_tokens: int) -> BenchRequest:
    return BenchRequest("", list(range(prompt_len)), max_tokens)


# Lengths at their end: 15, 40 and 5 tokens.
TOY = [toy(10, 5), toy(30, 10), toy(3, 2)]


def test_toy_workload_in_96_slots_of_16_token_blocks():
    paged, at_max_len, at_workload_max = simulate(TOY, num_slots=96, block_size=16, max_model_len=64)
    # Paged: 1 + 3 + 1 = 5 of 6 blocks; 80 slots hold 60 tokens.
    assert (paged.concurrent_sequences, paged.allocated_slots, paged.used_slots) == (3, 80, 60)
    assert paged.waste == pytest.approx(20 / 80)
    # Contiguous at max_model_len 64: one fits (128 > 96); 64 slots hold 15 tokens.
    assert (at_max_len.concurrent_sequences, at_max_len.allocated_slots, at_max_len.used_slots) == (1, 64, 15)
    assert at_max_len.waste == pytest.approx(49 / 64)
    # Contiguous at prompt_max + max_tokens_max = 30 + 10 = 40: two fit (120 > 96); 80 slots hold 55.
    assert (at_workload_max.concurrent_sequences, at_workload_max.allocated_slots) == (2, 80)
    assert at_workload_max.waste == pytest.approx(25 / 80)


def test_admission_stops_at_the_first_request_that_does_not_fit():
    assert admit_in_order([3, 3, 1], capacity=5) == 1  # FCFS: the small third one waits behind the second
    assert admit_in_order([2, 2, 2], capacity=6) == 3
    assert admit_in_order([7], capacity=6) == 0


def test_partial_blocks_round_up_and_empty_allocations_waste_nothing():
    assert paged_allocation([16, 17], num_blocks=2, block_size=16).concurrent_sequences == 1
    empty = contiguous_allocation("contiguous", [100], num_slots=50, reserve=64)
    assert (empty.concurrent_sequences, empty.waste) == (0, 0.0)


def test_live_measurement_aggregates_samples():
    samples = [LiveSample(2, 64, 48), LiveSample(3, 80, 60), LiveSample(0, 0, 0)]
    live = LiveMeasurement.from_samples(samples, num_preemptions=1)
    assert live.max_running == 3 and live.num_steps == 3
    assert live.mean_running == pytest.approx(5 / 3)
    assert live.mean_waste == pytest.approx(0.25)  # both non-empty samples waste a quarter
