"""The connector's settings: the `kvring.*` keys of vLLM's
`kv_connector_extra_config`, read and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvring import KvringError
from kvring.extra_config import as_bool, positive, refuse_unknown


EAGER_GPU_MIN_LOAD_TOKENS = 1280
"""The shortest hit loaded by default on a GPU engine without CUDA graphs
(`KvringSettings.load_mode`)."""


@dataclass(frozen=True)
class KvringSettings:
    """The connector's `kvring.*` keys of `kv_connector_extra_config`."""

    name: str = "default"
    autostart: bool = True
    pool_bytes: str | None = None
    chunk_tokens: int | None = None
    timeout_s: float = 60.0
    load_timeout_s: float = 5.0
    async_load: bool | None = None
    """None: asynchronous exactly when vLLM schedules asynchronously
    (`load_mode`)."""
    layer_groups: int = 4
    min_load_tokens: int | None = None
    """A hit shorter than this is recomputed. None: EAGER_GPU_MIN_LOAD_TOKENS
    on a GPU engine without CUDA graphs, else 0 (`load_mode`)."""
    submit_s: float = 0.25
    """How long a hook waits for the server to take a request (a lookup, a
    store, a retrieve): a stopped server costs a step this once, then the
    connection is dropped and hooks miss until it answers again."""
    lookup_wait_s: float = 3.0
    store_tails: bool = True
    """Store and load a prompt's tail, its whole blocks past its last whole
    chunk, where a hit may cover the whole prompt (one chunk object a
    prompt and KV cache group)."""
    runtime_dir: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> KvringSettings:
        """Reads the settings; an unknown `kvring.` key is most likely a typo,
        so it is refused rather than ignored."""
        known = {
            "kvring.name",
            "kvring.autostart",
            "kvring.pool_bytes",
            "kvring.chunk_tokens",
            "kvring.timeout_s",
            "kvring.load_timeout_s",
            "kvring.async_load",
            "kvring.layer_groups",
            "kvring.min_load_tokens",
            "kvring.submit_s",
            "kvring.lookup_submit_s",  # the earlier name of submit_s
            "kvring.lookup_wait_s",
            "kvring.store_tails",
            "kvring.runtime_dir",
        }
        refuse_unknown(extra, known, "kv_connector_extra_config")
        chunk = extra.get("kvring.chunk_tokens")
        pool = extra.get("kvring.pool_bytes")
        runtime_dir = extra.get("kvring.runtime_dir")
        async_load = extra.get("kvring.async_load")
        min_load = extra.get("kvring.min_load_tokens")
        settings = cls(
            name=str(extra.get("kvring.name", cls.name)),
            autostart=as_bool("kvring.autostart", extra.get("kvring.autostart", cls.autostart)),
            pool_bytes=None if pool is None else str(pool),
            chunk_tokens=None if chunk is None else int(chunk),
            timeout_s=float(extra.get("kvring.timeout_s", cls.timeout_s)),
            load_timeout_s=float(extra.get("kvring.load_timeout_s", cls.load_timeout_s)),
            async_load=None if async_load is None else as_bool("kvring.async_load", async_load),
            layer_groups=int(extra.get("kvring.layer_groups", cls.layer_groups)),
            min_load_tokens=None if min_load is None else int(min_load),
            submit_s=float(extra.get("kvring.submit_s", extra.get("kvring.lookup_submit_s", cls.submit_s))),
            lookup_wait_s=float(extra.get("kvring.lookup_wait_s", cls.lookup_wait_s)),
            store_tails=as_bool("kvring.store_tails", extra.get("kvring.store_tails", cls.store_tails)),
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
        )
        if settings.chunk_tokens is not None and settings.chunk_tokens <= 0:
            raise KvringError(f"kvring.chunk_tokens must be positive, not {settings.chunk_tokens}")
        if settings.layer_groups < 1:
            raise KvringError(f"kvring.layer_groups must be at least 1, not {settings.layer_groups}")
        if settings.min_load_tokens is not None and settings.min_load_tokens < 0:
            raise KvringError(f"kvring.min_load_tokens must not be negative, not {settings.min_load_tokens}")
        for key in ("timeout_s", "load_timeout_s", "submit_s", "lookup_wait_s"):
            positive(f"kvring.{key}", getattr(settings, key))
        return settings

    def load_mode(self, async_scheduling: bool, cache_groups: int = 1, eager_gpu: bool = False) -> KvringSettings:
        """The settings with `async_load` and `min_load_tokens` decided for
        an engine that schedules asynchronously or not, and runs on a GPU
        without CUDA graphs (`eager_gpu`) or not.

        There a hit costs about 12 ms that a forward with CUDA graphs does
        not show, so a short hit is slower than recomputing it: measured on
        an H200 and an H100 (Llama-3-8B geometry, docs/benchmarks.md), hits
        of 768 and 1,024 tokens were slower than recomputing their prompts
        (44.6 against 30.6 ms; 38.7 against 34.4), hits of 1,280 tokens and
        more faster (27.0 against 39.6 ms). With CUDA graphs every hit
        measured, from 768 tokens, was faster.

        With asynchronous scheduling vLLM queues a request's next step
        before it learns how this one went: a load that fails in its own
        step would have that next step's token, sampled from KV that never
        landed, given to the user (vLLM discards only the failed step's). So loads are asynchronous there
        (a failed one is known before the request runs), and a load in the
        step is refused as a setting. So it is for a model of several KV
        cache groups: vLLM can recompute a failed load of one only when the
        request waited for it."""
        s = self
        if s.min_load_tokens is None:
            s = replace(s, min_load_tokens=EAGER_GPU_MIN_LOAD_TOKENS if eager_gpu else 0)
        if s.async_load is None:
            return replace(s, async_load=async_scheduling or cache_groups > 1)
        if not s.async_load and cache_groups > 1:
            raise KvringError(
                f"kvring.async_load=false: this model has {cache_groups} KV cache groups, and vLLM can "
                "recompute a failed load of such a model only when the request waited for it; "
                "leave kvring.async_load unset"
            )
        if not s.async_load and async_scheduling:
            raise KvringError(
                "kvring.async_load=false needs vLLM's synchronous scheduling (async_scheduling=False, "
                "--no-async-scheduling): with asynchronous scheduling a load that fails in its own step "
                "would give the user a token computed without its KV; leave kvring.async_load unset"
            )
        return s

