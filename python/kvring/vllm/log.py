"""The connector's logger: a child of vLLM's, so that its lines carry
vLLM's format and show at vLLM's level (INFO by default) in every process
of the engine."""

from __future__ import annotations

import logging

from kvring import log

logger = logging.getLogger("vllm.kvring")


def warn_throttled(key: str, msg: str, *args: object) -> None:
    """A warning at most every minute per `key` (`kvring.log`)."""
    log.warn_throttled(logger, key, msg, *args)
