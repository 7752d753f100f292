"""pytest wiring of the vLLM end-to-end tests: everything lives in
e2e_support.py; its fixtures and hooks are registered here."""

from e2e_support import (  # noqa: F401
    engine_factory,
    kvring_server_factory,
    procs,
    pytest_configure,
    pytest_terminal_summary,
    tiny_models,
)
