"""The autostart: a detached `kvring serve` for an engine integration that
found no server of its name (`kvring.autostart`, on by default)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from typing import Protocol


class ServerSettings(Protocol):
    """What an integration's settings say about its server."""

    @property
    def name(self) -> str: ...
    @property
    def autostart(self) -> bool: ...
    @property
    def pool_bytes(self) -> str | None: ...
    @property
    def chunk_tokens(self) -> int | None: ...
    @property
    def runtime_dir(self) -> str | None: ...
    @property
    def timeout_s(self) -> float: ...


def start_server(settings: ServerSettings, logger: logging.Logger) -> str:
    """Starts a detached `kvring serve` for `settings.name`; returns its log.

    The server outlives the engine (a new session, so the engine's shutdown
    signals do not reach it). An engine's processes may all start one at the
    same moment: the server refuses a second instance of a name, and the
    losers simply exit. The log goes to the temporary directory (the runtime
    directory is the server's to create, with its own permissions).
    """
    log_path = os.path.join(tempfile.gettempdir(), f"kvring-{os.getuid()}-{settings.name}-serve.log")
    cmd = [sys.executable, "-m", "kvring", "serve", "--name", settings.name]
    if settings.pool_bytes is not None:
        cmd += ["--pool-bytes", settings.pool_bytes]
    if settings.chunk_tokens is not None:
        cmd += ["--chunk-tokens", str(settings.chunk_tokens)]
    if settings.runtime_dir is not None:
        cmd += ["--runtime-dir", settings.runtime_dir]
    with open(log_path, "ab") as log:
        subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    logger.info("kvring: started a server named %r (%s); its log is %s", settings.name, " ".join(cmd), log_path)
    return log_path
