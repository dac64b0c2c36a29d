"""`python -m llmserve.cli ...`: the `llmserve` command without the console script's set-up."""

import sys

from llmserve.cli.main import main

sys.exit(main())
