"""Reading the `kvring.*` keys an engine passes through its own extra
configuration (vLLM's `kv_connector_extra_config`, SGLang's
`hicache_storage_backend_extra_config`): the values as JSON or a command
line gives them, and unknown keys refused (most likely typos)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvring import KvringError


def refuse_unknown(extra: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Raises on a `kvring.` key that is not in `known`."""
    known = set(known)
    unknown = sorted(k for k in extra if k.startswith("kvring.") and k not in known)
    if unknown:
        raise KvringError(f"unknown {where} keys {unknown}; known: {sorted(known)}")


def as_bool(key: str, value: Any) -> bool:
    """A JSON bool, or the strings a command line gives (`true`, `0`, ...)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise KvringError(f"{key} must be true or false, not {value!r}")


def positive(key: str, value: float) -> float:
    if not value > 0:
        raise KvringError(f"{key} must be positive, not {value}")
    return value
