"""The one error type every loading failure raises (the CLI prints it as one line, exit code 2)."""


class ModelLoadError(ValueError):
    pass
