"""`llmserve bench priority`: TTFT of an interactive stream under a flood of batch requests, with
FCFS and with priority scheduling."""

from __future__ import annotations

import argparse
import dataclasses

from llmserve.benchmarks import results as result_files
from llmserve.benchmarks.commands.common import add_output_arguments, save
from llmserve.benchmarks.workload import WorkloadSpec, build_workload
from llmserve.config import EngineArgs


def register(commands) -> None:
    parser = commands.add_parser("priority", help="interactive TTFT under a batch flood: priority vs FCFS")
    parser.add_argument("--batch-requests", type=int, default=64, help="the flood (priority 1), all at t=0")
    parser.add_argument("--batch-prompt-len", type=int, default=400)
    parser.add_argument("--batch-output-len", type=int, default=150)
    parser.add_argument("--interactive-requests", type=int, default=30, help="Poisson stream (priority 0)")
    parser.add_argument("--interactive-prompt-len", type=int, default=40)
    parser.add_argument("--interactive-output-len", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="interactive arrivals per second")
    add_output_arguments(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=cmd_priority)


def cmd_priority(args: argparse.Namespace) -> int:
    from llmserve.benchmarks.priority import run_timeline, summarize, timeline
    from llmserve.engine.llm_engine import LLMEngine

    engine_args = EngineArgs.from_cli_args(args)
    rows = []
    for policy in ("fcfs", "priority"):
        engine = LLMEngine(dataclasses.replace(engine_args, scheduling_policy=policy))
        engine.model_runner.wait_for_kv_prefault()
        batch = build_workload(
            WorkloadSpec(
                num_requests=args.batch_requests,
                seed=args.seed,
                fixed_prompt_len=args.batch_prompt_len,
                fixed_output_len=args.batch_output_len,
            ),
            engine.tokenizer,
        )
        interactive = build_workload(
            WorkloadSpec(
                num_requests=args.interactive_requests,
                seed=args.seed + 1,
                fixed_prompt_len=args.interactive_prompt_len,
                fixed_output_len=args.interactive_output_len,
            ),
            engine.tokenizer,
        )
        engine.add_request("warm-up", interactive[0].prompt_token_ids[:8])
        while engine.has_unfinished_requests():
            engine.step()
        ttft = run_timeline(engine, timeline(batch, interactive, args.rate, args.seed))
        rows.append(
            {
                "policy": policy,
                **{f"interactive_{k}": v for k, v in summarize(ttft[0]).items()},
                **{f"batch_{k}": v for k, v in summarize(ttft[1]).items()},
                "preemptions": engine.scheduler.num_preemptions,
            }
        )
        device = engine.config.model.device
        del engine
    print(
        result_files.format_table(
            rows, ["policy", "interactive_p50_ms", "interactive_p99_ms", "batch_p50_ms", "preemptions"]
        )
    )
    ratio = rows[0]["interactive_p99_ms"] / rows[1]["interactive_p99_ms"]
    print(f"interactive TTFT p99: priority scheduling is {ratio:.1f}x lower than FCFS")
    save(
        args,
        "priority",
        {"rows": rows, "p99_ratio": ratio, "engine_args": dataclasses.asdict(engine_args)},
        device,
    )
    if args.plot:
        from llmserve.benchmarks.table_plot import TablePanel, plot_table

        panels = [
            TablePanel(f"TTFT {column.replace('_', ' ')}", rows, ["policy"], column)
            for column in ("interactive_p50_ms", "interactive_p99_ms", "batch_p50_ms")
        ]
        plot_table(panels, args.plot)
    return 0
