"""The `llmserve bench` subcommands, one module each (registered by benchmarks/cli.py); common.py
holds the workload and output flags they share."""
