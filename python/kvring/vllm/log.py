"""The connector's logger: a child of vLLM's, so that its lines carry
vLLM's format and show at vLLM's level (INFO by default) in every process
of the engine."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("vllm.kvring")

_WARN_EVERY_S = 60.0
_last_warning: dict[str, float] = {}


def warn_throttled(key: str, msg: str, *args: object) -> None:
    """A warning at most every minute per `key`: per-request failures must
    not flood the log."""
    now = time.monotonic()
    if now - _last_warning.get(key, -_WARN_EVERY_S) >= _WARN_EVERY_S:
        _last_warning[key] = now
        logger.warning(msg, *args)
