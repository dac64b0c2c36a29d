"""`python -m llmserve.cli ...`: the `llmserve` command without the console script's set-up."""

from llmserve.cli.main import exit_without_teardown, main

exit_without_teardown(main())
