from tests.entrypoints.conftest import server, tiny_model_dir  # noqa: F401 - the shared fixtures
