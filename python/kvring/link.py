"""One engine process's connection to the kvring server, for an engine
integration (vLLM's connector, SGLang's storage backend): connect (or start
one), notice a lost server, reconnect at most every second."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable

import kvring
from kvring import Client, KvringError, NoServer
from kvring.launcher import ServerSettings, start_server
from kvring.log import warn_throttled

RECONNECT_INTERVAL_S = 1.0
"""While the server is gone, a new connection is tried at most this often:
every hook in between fails fast instead of waiting out a deadline."""

_FIRST_CONNECT_S = 1.0
_AUTOSTART_CONNECT_S = 10.0
# A server that accepts but does not answer (stopped) costs a reconnect
# attempt this long, once per RECONNECT_INTERVAL_S.
_RECONNECT_CONNECT_S = 0.05
_CALL_TIMEOUT_S = 5.0

# Call failures that mean the server is gone or not answering: the
# connection is dropped so that later hooks fail fast.
_LINK_ERRORS = (kvring.ServerGone, kvring.ServerTimeout, kvring.ProtocolError)


class ServerLink:
    """One process's connection to the kvring server, for one integration.

    `client()` is what every hook asks for: the client, or None while the
    server is gone. A lost server is noticed from the connection (or a call
    failing with ServerGone / ServerTimeout) and reconnected at most every
    `RECONNECT_INTERVAL_S`, so hooks fail fast in between (an attempt costs
    at most the connect timeout, plus the call timeout of its first calls
    against a server that accepts but does not answer).
    `on_connect`
    readies each new client (the chunk size check; the KV cache
    registration) and refuses it by raising KvringError. `logger` is the
    engine's (its lines then carry the engine's format); `config_hint`
    says where the engine's user sets `kvring.*` keys.
    """

    def __init__(
        self,
        settings: ServerSettings,
        engine_id: str | None,
        on_connect: Callable[[Client], None],
        on_drop: Callable[[], None] | None = None,
        *,
        logger: logging.Logger,
        config_hint: str,
    ) -> None:
        self._settings = settings
        self._log = logger
        self._config_hint = config_hint
        self._engine_id = engine_id
        self._on_connect = on_connect
        self._on_drop = on_drop
        self._retry_at = 0.0
        self._client: Client | None = self._connect_first()

    @property
    def current(self) -> Client | None:
        """The client as it is, without a reconnect attempt."""
        return self._client

    def _open(self, connect_timeout: float) -> Client:
        s = self._settings
        return Client(
            s.name,
            engine=self._engine_id,
            runtime_dir=s.runtime_dir,
            connect_timeout=connect_timeout,
            call_timeout=min(_CALL_TIMEOUT_S, s.timeout_s),
        )

    def _connect_first(self) -> Client:
        """Connects at start-up, starting a server if configured to; without
        one the engine does not start (the error says how to get one)."""
        s = self._settings
        try:
            client = self._open(_FIRST_CONNECT_S)
        except NoServer:
            if not s.autostart:
                raise KvringError(
                    f"no kvring server named {s.name!r} is running: start one "
                    f"(`{sys.executable} -m kvring serve --name {s.name}`) or set "
                    f'"kvring.autostart": true in {self._config_hint}'
                ) from None
            log_path = start_server(s, self._log)
            try:
                client = self._open(_AUTOSTART_CONNECT_S)
            except NoServer as e:
                raise KvringError(
                    f"started a kvring server named {s.name!r} but could not connect to it "
                    f"within {_AUTOSTART_CONNECT_S:.0f} s; see its log {log_path}"
                ) from e
        try:
            self._on_connect(client)
        except BaseException:
            client.close()
            raise
        return client

    def client(self) -> Client | None:
        """The connected client, or None while the server is gone."""
        c = self._client
        if c is not None:
            if not c.server_gone:
                return c
            self._drop("the server closed the connection")
        now = time.monotonic()
        if now < self._retry_at:
            return None
        self._retry_at = now + RECONNECT_INTERVAL_S
        try:
            c = self._open(_RECONNECT_CONNECT_S)
        except KvringError:
            return None
        try:
            self._on_connect(c)
        except KvringError as e:
            self._log.error("kvring: the server %r is back but cannot be used: %s", self._settings.name, e)
            c.close()
            return None
        self._log.warning("kvring: reconnected to the server %r", self._settings.name)
        self._client = c
        return c

    def failed(self, what: str, error: KvringError) -> None:
        """Notes a failed call: a gone or unresponsive server drops the
        connection; anything else is that one operation's failure."""
        if isinstance(error, _LINK_ERRORS) or (self._client is not None and self._client.server_gone):
            self._drop(f"{what}: {error}")
        else:
            warn_throttled(self._log, what, "kvring: %s failed: %s", what, error)

    def _drop(self, reason: str) -> None:
        # The next `client()` tries once at once (a restarted server is
        # found without delay), then at most every RECONNECT_INTERVAL_S.
        c = self._client
        if c is None:
            return
        # Jobs are given up while their connection is still there: a server
        # that is slow, not dead, must not copy into blocks the engine reuses.
        if self._on_drop is not None:
            self._on_drop()
        self._client = None
        self._log.warning(
            "kvring: lost the server %r (%s); until it is back, lookups miss, loads fail "
            "(the engine recomputes) and stores are skipped; retrying every %.0f s",
            self._settings.name,
            reason,
            RECONNECT_INTERVAL_S,
        )
        with contextlib.suppress(KvringError):
            c.close()

    def close(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            c.close()

