"""The draft head (proposers/draft_head.py): trained by `llmserve train-draft-head` on the target's own
outputs, tied to that target, proposing after each step for the next one where prompt lookup finds
no match. Greedy equality with no speculation, leaks and seeded sampling are in the shared
parametrized tests (test_greedy_equivalence.py, test_stops_blocks_sampling.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.draft_planner import DraftPlanner
from llmserve.core.step_plan import NewRequestData
from llmserve.request import DraftProposal, Request
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.head_training import (
    HeadTrainingConfig,
    TrainingText,
    collect_features,
    training_requests,
)
from llmserve.spec_decode.proposer import SampledBatch
from llmserve.spec_decode.proposers.draft_head import FORMAT, is_head_target, target_sample
from llmserve.worker.request_state import CachedRequestState

from .conftest import HEAD_TRAINING_FLAGS, make_llm, spec_kwargs


@pytest.fixture(scope="module")
def head_llm(target_dir, other_draft_dir, draft_head):
    kwargs = spec_kwargs("draft_head_only", target_dir, other_draft_dir, draft_head)
    return make_llm(target_dir, max_model_len=1024, **kwargs)  # the training prompts are long


def test_training_writes_a_head_tied_to_its_target(draft_head, head_llm):
    with safe_open(draft_head, framework="pt") as file:
        metadata = file.metadata()
        vocab_ids = file.get_tensor("vocab_ids")
        assert file.get_tensor("target_sample").shape == (64, 64)
    assert metadata["format"] == FORMAT
    assert metadata["intermediate_size"] == "256"
    assert len(vocab_ids) == 512 and len(set(vocab_ids.tolist())) == 512
    head = head_llm.engine.proposer.head
    assert head.vocab_ids.tolist() == vocab_ids.tolist()
    assert head.fc_in.weight.shape == (256, 2 * 64)


def test_a_head_for_another_model_or_a_non_head_is_refused(target_dir, other_draft_dir, draft_head, tmp_path):
    with pytest.raises(ValueError, match="trained for another model"):
        make_llm(other_draft_dir, **spec_kwargs("draft_head", other_draft_dir, other_draft_dir, draft_head))
    plain = tmp_path / "plain.safetensors"
    save_file({"weight": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="not an llmserve draft head"):
        make_llm(target_dir, speculative_method="draft_head", speculative_draft_head=str(plain))
    with pytest.raises(ValueError, match="cannot read draft head"):
        make_llm(target_dir, speculative_method="draft_head", speculative_draft_head=str(tmp_path / "none"))


def test_the_head_learns_its_training_text_through_the_whole_pipeline(head_llm):
    """A random tiny target's continuations follow no pattern a head could generalize, but the head
    can memorize its training answers: replaying those prompts, most drafts must be accepted. An
    off-by-one anywhere between the features, the labels and serving (which feature, which token,
    which draft position) would leave it guessing."""
    config = _training_config()
    prompts = [p for p, params in training_requests(head_llm.tokenizer, config) if params.is_greedy]
    before = copy.copy(head_llm.engine.spec_decode_stats)
    outputs = head_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=config.max_tokens))
    stats = head_llm.engine.spec_decode_stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    assert drafted > 50
    assert (stats.num_accepted_tokens - before.num_accepted_tokens) / drafted > 0.5
    assert all(o.spec_decode is not None for o in outputs)


def test_each_proposal_is_the_head_run_on_the_feature_of_the_last_token(target_dir, head_llm):
    """Every proposal the engine makes equals the head applied by hand to the target's final hidden
    state at the request's second-to-last position (the one its last token was sampled from) and to
    its last token, that hidden state taken from one prefill of the whole sequence. Four requests run
    as one batch, mostly accepting drafts (their prompts are training prompts the head memorized)."""
    prompts = [
        p for p, params in training_requests(head_llm.tokenizer, _training_config()) if params.is_greedy
    ]
    engine = head_llm.engine
    requests = {}
    for index, prompt in enumerate(prompts[-4:]):
        engine.add_request(f"traced-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=32))
        requests[f"traced-{index}"] = engine.scheduler.requests[f"traced-{index}"]
    proposals: dict[str, dict[int, list[int]]] = {request_id: {} for request_id in requests}
    accepted_before = engine.spec_decode_stats.num_accepted_tokens
    while engine.has_unfinished_requests():
        engine.step()
        for request_id, request in requests.items():
            if request.draft_proposal is not None:
                proposals[request_id][request.draft_proposal.num_tokens] = request.draft_proposal.token_ids
    assert engine.spec_decode_stats.num_accepted_tokens - accepted_before > 20  # multi-token steps
    plain = make_llm(target_dir, max_model_len=1024, prefix_caching=False)
    sequences = [list(r.all_token_ids) for r in requests.values()]
    text = TrainingText(sequences, [r.num_prompt_tokens for r in requests.values()], [True] * len(requests))
    proposer = engine.proposer
    checked = matches = 0
    with torch.inference_mode():
        for sequence, features, by_length in zip(
            sequences, collect_features(plain, text), proposals.values(), strict=True
        ):
            for num_tokens, drafts in by_length.items():
                feature, token, expected = (
                    features[num_tokens - 2 : num_tokens - 1],
                    sequence[num_tokens - 1],
                    [],
                )
                for _ in drafts:
                    feature = proposer.head(feature, proposer.embed_tokens(torch.tensor([token])))
                    token = int(proposer.head.vocab_ids[proposer.subset_head(feature).argmax(dim=-1)])
                    expected.append(token)
                checked += 1
                matches += expected == drafts
    assert checked > 20
    assert matches >= checked - 1  # float32: prefill and decode hidden states differ only in rounding


def _training_config() -> HeadTrainingConfig:
    return HeadTrainingConfig(
        **{name.lstrip("-").replace("-", "_"): value for name, value in _flag_pairs() if _is_training(name)}
    )


def _flag_pairs():
    flags = iter(HEAD_TRAINING_FLAGS)
    return [(name, _number(value)) for name, value in zip(flags, flags, strict=True)]


def _number(text: str):
    return float(text) if "." in text else int(text) if text.isdigit() else text


def _is_training(name: str) -> bool:
    return name.lstrip("-").replace("-", "_") in HeadTrainingConfig.__dataclass_fields__


def test_a_head_recognizes_its_target_in_any_dtype_and_serves_a_quantized_one(
    target_dir, other_draft_dir, draft_head
):
    def model(weight):
        return SimpleNamespace(model=SimpleNamespace(embed_tokens=torch.nn.Embedding.from_pretrained(weight)))

    weight = torch.randn(1000, 64)
    sample = target_sample(model(weight))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert is_head_target(sample, model(weight.to(dtype)))
    assert not is_head_target(sample, model(torch.randn(1000, 64)))
    assert not is_head_target(sample, model(weight[:, :32]))
    # int8 weights leave the tied embedding (the head's lm_head rows) as it is
    kwargs = spec_kwargs("draft_head_only", target_dir, other_draft_dir, draft_head)
    llm = make_llm(target_dir, quantization="int8-rtn", **kwargs)
    outputs = llm.generate([[5, 6, 7, 8] * 4], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 16
    assert llm.engine.spec_decode_stats.num_drafts > 0


def test_bad_training_settings_are_refused():
    with pytest.raises(ValueError, match="unroll"):
        HeadTrainingConfig(unroll=0)
    with pytest.raises(ValueError, match="num_sampled_chat"):
        HeadTrainingConfig(num_chat=0, num_sampled_chat=3)


def _request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=32, **params))


def _state(request_id: str, tokens: list[int], **params) -> CachedRequestState:
    """A decoding request as the model runner holds it (what proposers draft for): `tokens` end
    with its one output token (a request at its first token gets no drafts)."""
    params = SamplingParams(max_tokens=32, **params)
    data = NewRequestData(request_id, tokens[:-1], tokens[-1:], params, (), [], len(tokens) - 1)
    return CachedRequestState.from_new(data, torch.device("cpu"))


def test_proposals_follow_the_new_tokens_per_request_k_and_carry_q_when_sampling(head_llm, monkeypatch):
    proposer = head_llm.engine.proposer  # at most 3 drafts (the default)
    monkeypatch.setattr(proposer, "min_confidence", 0.0)  # every draft, however unsure
    requests = [
        _state("greedy", [5, 6, 7], temperature=0.0),
        _state("sampled", [5, 6, 7], temperature=0.9, top_k=20, seed=1),
        _state("one", [5, 6, 7], temperature=0.0, num_speculative_tokens=1),
        _state("off", [5, 6, 7], temperature=0.0, num_speculative_tokens=0),
    ]
    requests[1].spec_token_ids = [8]  # it verified one draft, accepted it and drew 9: two rows
    new_tokens = [[8], [8, 9], [8], [8]]
    features = torch.randn(len(requests) + 1, 64)
    proposals = proposer.propose(SampledBatch(requests, new_tokens, features))
    assert list(proposals) == ["greedy", "sampled", "one", "off"]
    greedy_proposal, sampled_proposal, one, off = proposals.values()
    assert off is None
    assert greedy_proposal.num_tokens == 4 and sampled_proposal.num_tokens == 5
    assert len(greedy_proposal.token_ids) == 3 and len(one.token_ids) == 1
    assert greedy_proposal.probs is None and one.probs is None
    subset = set(proposer.head.vocab_ids.tolist())
    assert set(greedy_proposal.token_ids + sampled_proposal.token_ids) <= subset
    q = sampled_proposal.probs
    assert q.shape == (3, head_llm.engine.config.model.arch.vocab_size)
    torch.testing.assert_close(q.sum(dim=-1), torch.ones(3))
    assert all(q[j, token] > 0 for j, token in enumerate(sampled_proposal.token_ids))
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[proposer.head.vocab_ids] = False
    assert q[:, outside].sum() == 0
    assert ((q > 0).sum(dim=-1) <= 20).all()  # top-k applies to q as to the target's p


def _head_config() -> SpeculativeConfig:
    return SpeculativeConfig.create("draft_head", None, 2, 4, None, None, 0)


def test_planner_takes_a_proposal_within_the_room_and_the_runner_the_q_of_those_drafts():
    planner = DraftPlanner(_head_config())
    fresh = _request("f", [1, 2, 3, 4], temperature=0.9)
    q = torch.arange(30.0).reshape(3, 10)
    fresh.draft_proposal = DraftProposal(fresh.num_tokens, [7, 8, 9], q)
    assert planner.plan(fresh, max_drafts=2) == 2
    assert fresh.spec_token_ids == [7, 8]
    fresh.clear_drafts()
    assert fresh.spec_token_ids == []
    held = _state("f", [1, 2, 3, 4], temperature=0.9)  # the runner keeps the q of its last proposal
    held.draft_probs = q
    held.set_drafts([7, 8])
    assert torch.equal(held.spec_token_probs, q[:2])
    held.set_drafts([])
    assert held.spec_token_ids == [] and held.spec_token_probs is None


def test_planner_ignores_a_proposal_for_another_context():
    planner = DraftPlanner(_head_config())
    stale = _request("s", [1, 2, 3, 4], temperature=0.0)
    stale.draft_proposal = DraftProposal(stale.num_tokens - 1, [7, 8, 9], None)  # before the last token
    assert planner.plan(stale, max_drafts=8) == 0
    assert planner.plan(_request("n", [1, 2, 3], temperature=0.0), max_drafts=8) == 0  # none yet


def test_config_defaults_and_bad_head_token_counts():
    config = _head_config()
    assert config.num_speculative_tokens == 7 and config.draft_head_tokens == 3
    with pytest.raises(ValueError, match="speculative_draft_head_tokens"):
        SpeculativeConfig.create("draft_head", 2, 2, 4, None, None, 0, draft_head_tokens=3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.create("ngram", 3, 2, 0, None, None, 0)  # lookup off only for draft_head


def test_drafts_end_where_the_chained_confidence_drops(head_llm, monkeypatch):
    proposer = head_llm.engine.proposer
    request = _state("c", [5, 6, 7], temperature=0.0)
    features = torch.randn(1, 64)
    monkeypatch.setattr(proposer, "min_confidence", 1.01)  # no chain is that sure
    assert proposer.propose(SampledBatch([request], [[8]], features))["c"].token_ids == []
    monkeypatch.setattr(proposer, "min_confidence", 0.0)
    assert len(proposer.propose(SampledBatch([request], [[8]], features))["c"].token_ids) == 3


@pytest.mark.cpu_kernels("avx2")  # the head is float32: its linears go to the float32 kernel
@pytest.mark.parametrize("min_confidence", [0.0, 0.05, 1.01])
def test_the_compiled_chain_drafts_exactly_what_the_head_does_op_by_op(head_llm, min_confidence, monkeypatch):
    """Greedy batches of up to 8 rows draft through kernels/csrc/draft_head.cpp in one call; its drafts
    and per-step confidence flags equal the Python loop's bit for bit, including where the chain
    stops early (no row sure any more), where some rows stop while others go on, and where it stops
    at once (no row sure)."""
    proposer = head_llm.engine.proposer
    chain = proposer.compiled_chain
    assert chain is not None
    generator = torch.Generator().manual_seed(0)
    stopped_early = mixed = False
    for rows in (1, 3, 8):
        features = torch.randn(rows, 64, generator=generator) * 3
        tokens = proposer.head.vocab_ids[torch.randint(0, 512, (rows,), generator=generator)]
        counts = [3] * rows
        monkeypatch.setattr(proposer, "min_confidence", min_confidence)
        with torch.inference_mode():
            drafts, confident = chain.greedy(features, tokens, 3, min_confidence)
            expected_drafts, expected_confident, _ = proposer._run(
                features, tokens, [None] * rows, [[0]] * rows, counts, sampling=False
            )
        assert torch.equal(drafts, expected_drafts)
        assert torch.equal(confident, expected_confident)
        if min_confidence > 1:
            assert drafts.shape == (rows, 1) and not confident.any()
        stopped_early |= drafts.shape[1] < 3
        mixed |= bool(confident[:, -1].any()) and not bool(confident.all())
    if min_confidence == 0.05:  # the cases the docstring names were met, not just the trivial ones
        assert stopped_early and mixed


@pytest.mark.cpu_kernels("bf16_linear")
def test_a_bf16_head_on_packed_copies_alone_builds_its_chain_and_drafts(
    target_dir, other_draft_dir, draft_head
):
    """In bf16 the head's linears keep only their packed copies (their weights freed): the compiled
    chain still builds and greedy speculation runs, equal to the same engine without speculation."""
    from llmserve import LLM

    kwargs = dict(dtype="bfloat16", kv_cache_memory="8MiB", max_model_len=256)
    spec = spec_kwargs("draft_head_only", target_dir, other_draft_dir, draft_head)
    llm = LLM(target_dir, speculative_disable_batch_size=0, **spec, **kwargs)
    plain = LLM(target_dir, **kwargs)
    try:
        proposer = llm.engine.proposer
        assert proposer.subset_head.weight is None and proposer.compiled_chain is not None
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9, 10], [100, 200, 300]]
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        theirs = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert ours == theirs
    finally:
        llm.shutdown()
        plain.shutdown()


def test_prompt_lookup_proposes_where_it_finds_a_match_and_the_head_elsewhere(
    target_dir, other_draft_dir, draft_head, head_llm, monkeypatch
):
    llm = make_llm(target_dir, **spec_kwargs("draft_head", target_dir, other_draft_dir, draft_head))
    proposer = llm.engine.proposer
    repeating, fresh = (
        _state("r", [5, 1, 2, 1, 2, 1], temperature=0.0),
        _state("f", [1, 2, 3], temperature=0.0),
    )
    proposer.min_confidence = 0.0
    proposals = proposer.propose(SampledBatch([repeating, fresh], [[2], [4]], torch.randn(2, 64)))
    # [5, 1, 2, 1, 2, 1, 2]: a 4-token match, so up to K = 7 drafts (the head drafts at most 3)
    assert proposals["r"] == DraftProposal(7, [1, 2, 1, 2, 1, 2, 1])
    assert len(proposals["f"].token_ids) == 3
    head_only = head_llm.engine.proposer  # prompt_lookup_max 0: the head everywhere
    monkeypatch.setattr(head_only, "min_confidence", 0.0)
    proposals = head_only.propose(SampledBatch([repeating], [[2]], torch.randn(1, 64)))
    assert len(proposals["r"].token_ids) == 3


@pytest.mark.cpu_kernels("int8_linear")
def test_an_untied_quantized_lm_head_gives_its_rows_exactly():
    """A GGUF's own output blocks (untied, served by default in them): the draft head's subset rows are
    the kernel's exact rows; a kernel that cannot rebuild rows is refused in one line."""
    from llmserve.quantization.formats import Int8Weight
    from llmserve.quantization.kernels import LinearKernel, QuantizedLinear
    from llmserve.spec_decode.proposers.draft_head import subset_lm_head_weight

    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (70, 64), generator=gen, dtype=torch.int8)
    weight = Int8Weight(codes, (torch.rand(70, 2, generator=gen) * 0.01).half().float(), 32)
    head = QuantizedLinear(weight, None, torch.bfloat16, "cpu", float_logits=True)
    target = SimpleNamespace(arch=SimpleNamespace(tie_word_embeddings=False), lm_head=head)
    ids = torch.tensor([0, 5, 69, 33])
    assert torch.equal(subset_lm_head_weight(target, ids), weight.dequantize(torch.float32)[ids])
    head.kernel = LinearKernel()
    head.kernel.register_buffer("codes", codes)
    with pytest.raises(ValueError, match="cannot rebuild exactly"):
        subset_lm_head_weight(target, ids)
