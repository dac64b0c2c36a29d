"""`llmserve eval ppl`: perplexity on held-out text and batch-1 decode speed, with any engine flags."""

from __future__ import annotations

import argparse
import dataclasses

from llmserve.config import EngineArgs


def register(subparsers) -> None:
    evaluate = subparsers.add_parser("eval", help="model quality: ppl (perplexity on held-out text)")
    commands = evaluate.add_subparsers(dest="evaluation", required=True, parser_class=type(evaluate))
    ppl = commands.add_parser("ppl", help="perplexity through the engine, and batch-1 decode ms/token")
    ppl.add_argument("--text", default=None, help="UTF-8 text file (default: Python's LICENSE.txt)")
    ppl.add_argument("--max-tokens", type=int, default=2048, help="score the text's first N tokens")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window (each scored from scratch)")
    ppl.add_argument("--decode-tokens", type=int, default=64, help="tokens of the timed decode (0: skip)")
    ppl.add_argument(
        "--output", default=None, help="also write a JSON result (machine, command, date, commit, figures)"
    )
    EngineArgs.add_cli_args(ppl)
    ppl.set_defaults(handler=cmd_ppl)


def cmd_ppl(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.evaluation.perplexity import default_text_path, evaluate_perplexity

    if args.max_tokens < 2 or args.context < 2 or args.decode_tokens < 0:
        raise ValueError("--max-tokens and --context must be >= 2, --decode-tokens >= 0")
    path = args.text or default_text_path()
    with open(path, encoding="utf-8") as file:  # OSError / UnicodeDecodeError (a ValueError): one line
        text = file.read()
    # prefix caching off: every window is computed
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), prefix_caching=False)
    engine = LLMEngine(engine_args)
    token_ids = engine.tokenizer.encode(text)[: args.max_tokens]
    if len(token_ids) < 2:
        raise ValueError(f"{path} has fewer than 2 tokens")
    result = evaluate_perplexity(engine, token_ids, args.context, args.decode_tokens)
    quantization = engine.config.model.quantization
    print(
        f"model {engine.config.model.path} ({engine.config.model.dtype}, "
        f"quantization {quantization.method if quantization else 'none'})"
    )
    print(f"text {path}: {result.tokens} tokens scored in {result.windows} windows of <= {args.context}")
    print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token)")
    if result.decode_ms_per_token is not None:
        print(f"batch-1 decode {result.decode_ms_per_token:.2f} ms/token ({args.decode_tokens} tokens)")
    if args.output:
        print(f"result: {_save(args, engine, engine_args, path, result)}")
    return 0


def _save(args: argparse.Namespace, engine, engine_args: EngineArgs, text_path: str, result):
    """The result file: `llmserve bench`'s run metadata, the settings, and the figures."""
    from llmserve.benchmarks.results import run_metadata, write_result

    model = engine.config.model
    quantization = model.quantization
    payload = {
        **run_metadata("eval-ppl", model.device),
        "model": str(model.path),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": dataclasses.asdict(quantization) if quantization else None,
        "kv_cache_dtype": engine.config.cache.kv_cache_dtype,
        "engine_args": dataclasses.asdict(engine_args),
        "text": text_path,
        "max_tokens": args.max_tokens,
        "context": args.context,
        "decode_tokens": args.decode_tokens,
        "tokens": result.tokens,
        "windows": result.windows,
        "nll": result.nll,
        "perplexity": result.perplexity,
        "decode_ms_per_token": result.decode_ms_per_token,
    }
    return write_result(args.output, payload)
