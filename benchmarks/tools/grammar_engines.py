"""xgrammar against llguidance on this machine: compile time of a 50-property JSON schema and the time
to fill the token masks of a batch of 32 requests partway through that schema.

    python -m benchmarks.tools.grammar_engines [--model PATH] [--batch 32] [--steps 20]

Each engine gets the model's tokenizer, compiles the schema (xgrammar: `GrammarCompiler` with its cache
off; llguidance: `LLMatcher` construction, which builds its lexer lazily), then advances `batch`
matchers along one valid JSON document and times filling all their masks per step (xgrammar: one
`fill_next_token_bitmask` per matcher; llguidance: `fill_next_token_bitmask_par`, one call, threads).
Prints one JSON line per engine. Run it on a quiet machine; on a loaded one only the ratio counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def fifty_property_schema() -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b", "c"]}]
    props = {f"field_{i}": kinds[i % 4] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def sample_document() -> str:
    values = ['"The quick brown fox jumps over the lazy dog"', "7", "true", '"b"']
    return json.dumps({f"field_{i}": json.loads(values[i % 4]) for i in range(50)}, separators=(",", ":"))


def _xgrammar(hf, schema: str, doc_ids: list[int], batch: int, steps: int, vocab: int) -> dict:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema)
    compile_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgrammar.allocate_token_bitmask(batch, info.vocab_size)
    times = []
    for token in doc_ids[:steps]:
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        times.append(time.perf_counter() - start)
        for matcher in matchers:
            assert matcher.accept_token(token)
    return {"engine": "xgrammar", "compile_ms": compile_s * 1e3, "mask_ms_batch": _ms(times)}


def _llguidance(hf, schema: str, doc_ids: list[int], batch: int, steps: int, vocab: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    first = llguidance.LLMatcher(tokenizer, grammar)
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    llguidance.torch.fill_next_token_bitmask(first, mask, 0)  # the lazy part of compiling: the first mask
    compile_s = time.perf_counter() - start
    assert not first.is_error(), first.get_error()
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    bitmask = llguidance.torch.allocate_token_bitmask(batch, tokenizer.vocab_size)
    executor = llguidance.LLExecutor()
    times = []
    for token in doc_ids[:steps]:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        times.append(time.perf_counter() - start)
        for matcher in matchers:
            assert matcher.consume_token(token), matcher.get_error()
    return {"engine": "llguidance", "compile_ms": compile_s * 1e3, "mask_ms_batch": _ms(times)}


def _ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def main() -> None:
    from llmserve.model_loader.default_model import resolve_model_path
    from llmserve.model_loader.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    hf = tokenizer.hf
    schema = json.dumps(fifty_property_schema())
    doc_ids = tokenizer.encode(sample_document(), add_special_tokens=False)
    torch.set_num_threads(1)
    for run in (_xgrammar, _llguidance):
        print(json.dumps(run(hf, schema, doc_ids, args.batch, args.steps, tokenizer.vocab_size)), flush=True)


if __name__ == "__main__":
    main()
