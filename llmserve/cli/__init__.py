"""The `llmserve` command, one module per subcommand.

    launch.py            the console script: process set-up (tcmalloc, OpenMP spin), then main.py
    main.py              the parser and `main`: every subcommand module below registers itself
    args.py              sampling flags shared by generate and chat (engine flags: EngineArgs.add_cli_args)
    generate.py, chat.py, serve.py, evaluate.py (eval), quantize.py, train_draft_head.py
    llmserve/benchmarks/cli.py   `llmserve bench ...`, dispatching to llmserve/benchmarks/commands/

The command sits above everything it runs (the server, the benchmarks, training, quantization), so
this package stays light to import: launch.py must run before torch loads.
"""
