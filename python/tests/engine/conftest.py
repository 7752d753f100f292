"""Fixtures of the mini-engine tests: the device (CUDA when torch sees one,
else CPU with the host backend), a real kvring server per test (the
`Server` of ../conftest.py), and the engine processes, started once per
allocation environment and reused by the tests (killed at the end, and at
once after a failure)."""

from __future__ import annotations

import importlib.util
import os

import pytest

import standin_vllm
from mini_engine import DEVICE, EngineProcesses, alloc_env

_spec = importlib.util.spec_from_file_location(
    "kvring_tests_conftest", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conftest.py")
)
_parent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_parent)
Server = _parent.Server


def pytest_report_header(config: pytest.Config) -> str:
    forced = os.environ.get(standin_vllm.FORCE_ENV) == "1"
    return (
        f"mini engine: device {DEVICE}; vLLM: "
        + ("the stand-in (forced)" if forced else "real where importable, else the stand-in")
    )


@pytest.fixture
def kv_server():
    """A `kvring serve` with 64-token chunks and a 256 MiB pool, on the
    device's backend."""
    s = Server("--chunk-tokens", "64", "--pool-bytes", "256MiB", backend="cuda" if DEVICE == "cuda" else "host")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def engines():
    """`engines(kind)`: live engine processes for allocation `kind` (one
    scheduler, two workers), started with that kind's environment."""
    pools: dict[tuple, EngineProcesses] = {}

    def get(kind: str) -> EngineProcesses:
        env = tuple(sorted(alloc_env(kind).items()))
        pool = pools.get(env)
        if pool is None or not pool.alive:
            pool = pools[env] = EngineProcesses(DEVICE, workers=2, env=dict(env))
        return pool

    yield get
    for pool in pools.values():
        pool.close()
