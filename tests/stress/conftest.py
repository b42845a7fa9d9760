from tests.e2e.conftest import tiny_model  # noqa: F401 - the session's model, built once
