"""Fixtures of the SGLang storage backend's tests: SGLang's storage module
(real or the stand-in, `standin_sglang`) and a real kvring server (the
`Server` of ../conftest.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest

import standin_sglang

_WHICH = standin_sglang.install()

_spec = importlib.util.spec_from_file_location(
    "kvring_api_conftest", os.path.join(os.path.dirname(__file__), "..", "conftest.py")
)
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
Server = _parent.Server


def pytest_report_header(config: pytest.Config) -> str:
    return f"SGLang's storage interface: {_WHICH}"


@pytest.fixture
def server():
    s = Server("--chunk-tokens", "64", "--pool-bytes", "64MiB", "--copy-threads", "1")
    yield s
    s.stop()
