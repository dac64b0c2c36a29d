"""Structured outputs below the server: the compiler (cache, refusals), a matcher kept in step with
each row's tokens (advance, rollback, refusal), and the grammar mask through the sampler, its greedy
fast path and the speculative verifier, on the default model's real tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from llmserve.model_loader import default_model_path, load_tokenizer
from llmserve.sample.metadata import SamplingMetadata
from llmserve.sample.sampler import Sampler, leaves_logits_unchanged
from llmserve.sample.verifier import DraftVerifier
from llmserve.sampling_params import SamplingParams
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from llmserve.structured.params import GrammarError, StructuredOutputsParams

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, tokenizer.eos_token_ids)
    yield compiler
    compiler.shutdown()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def state(compiler, **spec) -> GrammarState:
    return GrammarState(compiler.compile(StructuredOutputsParams(**spec)))


def build(params, outputs, grammars) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=[[1]] * rows,
        output_token_ids=outputs,
        generators=[None] * rows,
        eos_token_ids=[(2,)] * rows,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        grammars=grammars,
    )


def test_equal_schemas_share_one_compile_and_refusals_are_not_cached(compiler):
    a = StructuredOutputsParams.from_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams.from_schema('{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a == b and compiler.submit(a) is compiler.submit(b)
    bad = StructuredOutputsParams(regex="(?<=a)b")
    with pytest.raises(GrammarError, match="regex: .*[Ll]ookbehind"):
        compiler.compile(bad)
    assert bad.key not in compiler._cache


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {"minLength": 2}}}}, "if"),
    ],
)
def test_schema_keywords_the_engine_would_ignore_are_refused(compiler, schema, keyword):
    with pytest.raises(GrammarError, match=f"'{keyword}'"):
        compiler.compile(StructuredOutputsParams.from_schema(schema))


def test_a_property_named_like_a_keyword_is_fine(compiler, tokenizer):
    schema = {"type": "object", "properties": {"not": {"type": "string"}}, "required": ["not"]}
    grammar = GrammarState(compiler.compile(StructuredOutputsParams.from_schema(schema)))
    assert grammar.sync(ids(tokenizer, '{"not": "x"}'))  # the keyword-named property is a property
    assert not GrammarState(compiler.compile(StructuredOutputsParams.from_schema(schema))).sync(
        ids(tokenizer, '{"other": "x"}')
    )


def test_invalid_grammars_are_refused(compiler):
    with pytest.raises(GrammarError, match="grammar: .*not defined"):
        compiler.compile(StructuredOutputsParams(grammar='root ::= "a" | b'))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar='root ::= "a"')


def test_the_matcher_follows_advances_rollbacks_and_refusals(compiler, tokenizer):
    grammar = state(compiler, grammar='root ::= "yes" | "no"')
    yes, no, eos = ids(tokenizer, "yes")[0], ids(tokenizer, "no")[0], tokenizer.eos_token_ids[0]
    assert grammar.sync([yes]) and grammar.tokens == [yes]
    assert grammar.sync([yes, eos])  # the grammar is complete: the end of sequence is allowed
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    assert not grammar.fill(bitmask, 0) and len(allowed(bitmask[0])) == VOCAB  # past the end: moot
    assert grammar.sync([no]) and grammar.tokens == [no]  # two rolled back, one accepted
    assert not grammar.sync([no, no]) and grammar.tokens == [no]  # refused: stays at the valid prefix
    assert grammar.sync([]) and grammar.tokens == []


def allowed(bitmask_row: torch.Tensor) -> set[int]:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:VOCAB]).flatten().tolist())


def test_greedy_and_sampled_rows_pick_only_what_the_grammar_allows(compiler, tokenizer):
    choice = StructuredOutputsParams(choice=("yes", "no"))
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 5
    params = [
        SamplingParams(temperature=0.0, structured_outputs=choice),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, structured_outputs=choice),
    ]
    grammars = [GrammarState(compiler.compile(choice)), None, GrammarState(compiler.compile(choice))]
    metadata = build(params, [[], [], []], grammars)
    assert not leaves_logits_unchanged(metadata)  # the greedy fast path steps aside
    for _ in range(20):
        tokens = Sampler()(logits, metadata).sampled_token_ids.tolist()
        for row in (0, 2):  # a first token of either word ("y" of "y" + "es" counts)
            text = tokenizer.decode([tokens[row]])
            assert text and ("yes".startswith(text) or "no".startswith(text)), text
        assert tokens[1] == int(logits[1].argmax())  # the row without a grammar is untouched


def test_a_grammar_row_without_its_state_is_an_error_not_a_free_row():
    params = [SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a"))]
    with pytest.raises(RuntimeError, match="grammar"):
        build(params, [[]], None)


def test_log_probs_describe_the_masked_distribution(compiler, tokenizer):
    choice = StructuredOutputsParams(choice=("yes", "no"))
    logits = torch.zeros(1, VOCAB)
    params = [SamplingParams(temperature=0.0, logprobs=3, structured_outputs=choice)]
    out = Sampler()(logits, build(params, [[]], [GrammarState(compiler.compile(choice))]))
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    GrammarState(compiler.compile(choice)).fill(bitmask, 0)
    first = allowed(bitmask[0])  # every token that starts "yes" or "no"
    top = dict(zip(out.logprobs_token_ids[0].tolist(), out.logprobs[0].tolist(), strict=True))
    expected = -torch.log(torch.tensor(float(len(first)))).item()  # uniform over the allowed tokens
    assert {t for t, lp in top.items() if lp > -1e30} <= first
    assert all(lp == pytest.approx(expected, abs=1e-4) for t, lp in top.items() if t in first)


@dataclass
class Row:
    request_id: str
    sampling_params: SamplingParams
    grammar: GrammarState | None
    spec_token_ids: list[int]
    prompt_token_ids: list[int] = field(default_factory=lambda: [1])
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = (2,)
    generator: torch.Generator | None = None


def test_the_verifier_rejects_drafts_the_grammar_refuses(compiler, tokenizer):
    """Greedy target logits prefer the drafts everywhere; the grammar allows `"ab"` only: the first
    draft (`"a` plus a refused token) is accepted up to the grammar, the rest is rejected."""
    spec = StructuredOutputsParams(regex='"ab"')
    quote, a, b = ids(tokenizer, '"')[0], ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    wrong = ids(tokenizer, "c")[0]
    drafts = [quote, a, wrong]
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    for row, token in enumerate(drafts):
        logits[row, token] = 10.0  # the target agrees with every draft
    request = Row("r", SamplingParams(temperature=0.0, structured_outputs=spec), None, drafts)
    request.grammar = GrammarState(compiler.compile(spec))
    tokens, _ = DraftVerifier(VOCAB, torch.device("cpu"))(logits, [request], {})
    assert tokens["r"][:2] == [quote, a] and tokens["r"][2] == b  # "c" refused: the grammar's "b" instead
    # the next step's rows follow the accepted tokens only: the matcher rolls the refused draft back
    assert request.grammar.sync(tokens["r"]) and request.grammar.tokens == [quote, a, b]


def test_a_json_schema_document_is_accepted_token_by_token(compiler, tokenizer):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
        "required": ["name", "tags"],
    }
    grammar = GrammarState(compiler.compile(StructuredOutputsParams.from_schema(schema)))
    good = ids(tokenizer, json.dumps({"name": "Ada", "tags": ["x", "y"]}))
    assert grammar.sync(good) and grammar.sync([*good, tokenizer.eos_token_ids[0]])
    bad = ids(tokenizer, json.dumps({"name": "Ada", "tags": ["z"]}))
    assert not GrammarState(compiler.compile(StructuredOutputsParams.from_schema(schema))).sync(bad)
