"""Warnings that must not flood a log: per-request failures are logged at
most once a minute for each kind."""

from __future__ import annotations

import logging
import time

WARN_EVERY_S = 60.0

_last_warning: dict[tuple[str, str], float] = {}


def warn_throttled(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """A warning on `logger` at most every `WARN_EVERY_S` seconds per `key`."""
    now = time.monotonic()
    k = (logger.name, key)
    if now - _last_warning.get(k, -WARN_EVERY_S) >= WARN_EVERY_S:
        _last_warning[k] = now
        logger.warning(msg, *args)
