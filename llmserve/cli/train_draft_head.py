"""`llmserve train-draft-head`: train a draft head for a model on its own outputs and save it."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

from llmserve.config import EngineArgs


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train-draft-head",
        help="train a draft head (--speculative-method draft_head) on text the model generates itself",
    )
    train.add_argument("--output", required=True, help="the head's file to write (.safetensors)")
    train.add_argument(
        "--text-cache",
        default=None,
        help="file for the generated text and its features: reused when it exists (training other sizes)",
    )
    defaults = _training_defaults()
    group = train.add_argument_group("training")
    for name, default in defaults.items():
        if name not in ("feature_loss_weight", "held_out", "seed"):  # --seed is the engine's, used for both
            group.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    EngineArgs.add_cli_args(train)
    train.set_defaults(handler=cmd_train_draft_head)


def _training_defaults() -> dict:
    from llmserve.spec_decode.head_training import HeadTrainingConfig

    return dataclasses.asdict(HeadTrainingConfig())


def cmd_train_draft_head(args: argparse.Namespace) -> int:
    import torch

    from llmserve.entrypoints.llm import LLM
    from llmserve.spec_decode.head_training import (
        HeadTrainingConfig,
        TrainingText,
        collect_features,
        generate_text,
        train_draft_head,
    )
    from llmserve.spec_decode.proposers.draft_head import is_head_target, save_draft_head, target_sample

    config = HeadTrainingConfig(**{k: getattr(args, k) for k in _training_defaults() if hasattr(args, k)})
    engine_args = EngineArgs.from_cli_args(args)
    engine_args = dataclasses.replace(engine_args, prefix_caching=False, speculative_method=None)
    if engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size > 1:  # logits outside the steps
        raise ValueError("train-draft-head does not run under tensor or pipeline parallelism yet")
    llm = LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})
    target = llm.engine.model_runner.model
    if args.text_cache and os.path.exists(args.text_cache):
        print(f"reading the training text and features from {args.text_cache}", flush=True)
        cached = torch.load(args.text_cache)
        if not is_head_target(cached["target_sample"], target):
            raise ValueError(f"{args.text_cache} holds another model's text and features")
        text, features = TrainingText(**cached["text"]), cached["features"]
    else:
        print("generating the training text ...", flush=True)
        text = generate_text(llm, config)
        print(f"computing the features of {len(text.sequences)} sequences ...", flush=True)
        features = collect_features(llm, text)
        if args.text_cache:
            cache = {
                "text": dataclasses.asdict(text),
                "features": features,
                "target_sample": target_sample(target),
            }
            torch.save(cache, args.text_cache)
    if config.medusa_heads:
        return _train_medusa(args.output, llm, target, text, features, config)
    head, report = train_draft_head(
        target, text, features, config, progress=functools.partial(print, flush=True)
    )
    report["target"] = os.path.basename(llm.engine.config.model.path)
    save_draft_head(args.output, head, target, report)
    print(json.dumps(report, indent=1))
    print(f"wrote {args.output}; use: --speculative-method draft_head --speculative-draft-head {args.output}")
    return 0


def _train_medusa(output: str, llm, target, text, features, config) -> int:
    """--medusa-heads K: Medusa heads instead of a draft head, saved in the published layout."""
    from llmserve.spec_decode.medusa_training import train_medusa_heads
    from llmserve.spec_decode.proposers.medusa import save_medusa_heads

    heads, report = train_medusa_heads(
        target, text, features, config, progress=functools.partial(print, flush=True)
    )
    report["target"] = os.path.basename(llm.engine.config.model.path)
    save_medusa_heads(output, heads, {"info": json.dumps(report)})
    print(json.dumps(report, indent=1))
    print(f"wrote {output}; use: --speculative-method medusa --speculative-draft-head {output}")
    return 0
