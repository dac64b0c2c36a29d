"""`llmserve quantize`: quantize a model once and save the result, for `--quantization DIR` later."""

from __future__ import annotations

import argparse
import dataclasses
import os

from llmserve.config import EngineArgs

SAVABLE = ("int8", "int8-rtn", "int4", "awq", "gptq")


def register(subparsers) -> None:
    quantize = subparsers.add_parser(
        "quantize", help="quantize a model (int8, int8-rtn, int4, awq, gptq) and save a checkpoint directory"
    )
    quantize.add_argument("--output", required=True, help="directory to write (created if missing)")
    EngineArgs.add_cli_args(quantize)
    quantize.set_defaults(handler=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from llmserve.model_loader import load_arch_config, load_tokenizer, load_weights, resolve_model_path
    from llmserve.models.registry import build_model
    from llmserve.quantization.checkpoint import save_quantized, source_id
    from llmserve.quantization.methods import quantize_model

    if args.quantization not in SAVABLE:
        raise ValueError(
            f"--quantization must be one of {', '.join(SAVABLE)} to save; got {args.quantization!r}"
        )
    path = resolve_model_path(args.model)
    # Quantize from float32 weights whatever the serving dtype; no KV pool is built.
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), dtype="float32", kv_cache_memory="1MiB")
    config = engine_args.create_config(load_arch_config(path), path).model
    tokenizer = load_tokenizer(path, None if os.path.isdir(path) else config.arch.eos_token_ids)
    model = build_model(config, load_weights(path, config.dtype))
    result = quantize_model(model, config, tokenizer)
    info = {
        "method": config.quantization.method,
        "group_size": config.quantization.group_size,
        "source": path,
        "source_id": source_id(path),
    }
    save_quantized(args.output, result.weights, info, result.float_updates)
    print(f"wrote {len(result.weights)} quantized layers to {args.output}")
    print(f"use: --model {path} --quantization {args.output}")
    return 0
