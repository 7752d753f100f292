"""The storage backend's settings: the `kvring.*` keys of SGLang's
`hicache_storage_backend_extra_config`, read and checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvring import KvringError
from kvring.extra_config import as_bool, positive, refuse_unknown


@dataclass(frozen=True)
class StorageSettings:
    """The backend's `kvring.*` keys (all optional)."""

    name: str = "default"
    autostart: bool = True
    pool_bytes: str | None = None
    """The pool of a server this backend starts (`kvring serve --pool-bytes`)."""
    runtime_dir: str | None = None
    model: str | None = None
    """The model's name in kvring's keys; default SGLang's served model name."""
    submit_s: float = 0.05
    """How long a call waits for the server to take a request: a stopped
    server costs a call this once, then the connection is dropped and calls
    miss until the server answers again."""
    stall_s: float = 0.25
    """A server that has not beaten (every 50 ms) for this long is taken as
    stopped: a wait for its answer is given up then, not at its deadline."""
    lookup_wait_s: float = 2.5
    """How long an existence check waits for an answer the server is
    reading from its second tier (its own wait there is 2 s)."""
    timeout_s: float = 30.0
    """The deadline of one store or load (a batch of at most 128 pages) on
    a server that keeps beating."""

    chunk_tokens: int | None = None
    """Not a key: SGLang's page size, the chunk size of a server this
    backend starts (`dataclasses.replace` once the host pool is known)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        extra = dict(extra or {})
        refuse_unknown(
            extra,
            (f"kvring.{k}" for k in ("name", "autostart", "pool_bytes", "runtime_dir", "model",
                                      "submit_s", "stall_s", "lookup_wait_s", "timeout_s")),
            "hicache_storage_backend_extra_config",
        )
        if not as_bool("interface_v1", extra.get("interface_v1", False)):
            raise KvringError(
                'kvring moves pages between SGLang\'s host pool and its own without a copy through '
                'Python: add "interface_v1": 1 to hicache_storage_backend_extra_config'
            )

        def opt(key: str) -> str | None:
            v = extra.get(f"kvring.{key}")
            return None if v is None else str(v)

        def seconds(key: str) -> float:
            return positive(f"kvring.{key}", float(extra.get(f"kvring.{key}", getattr(cls, key))))

        return cls(
            name=str(extra.get("kvring.name", cls.name)),
            autostart=as_bool("kvring.autostart", extra.get("kvring.autostart", cls.autostart)),
            pool_bytes=opt("pool_bytes"),
            runtime_dir=opt("runtime_dir"),
            model=opt("model"),
            submit_s=seconds("submit_s"),
            stall_s=seconds("stall_s"),
            lookup_wait_s=seconds("lookup_wait_s"),
            timeout_s=seconds("timeout_s"),
        )
