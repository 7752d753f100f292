"""The connector's link to its kvring server (`kvring.link.ServerLink` on
vLLM's logger) and the chunk size a vLLM engine and the server agree on."""

from __future__ import annotations

from collections.abc import Callable

from kvring import Client, KvringError
from kvring.link import RECONNECT_INTERVAL_S, ServerLink
from kvring.vllm.log import logger
from kvring.vllm.settings import KvringSettings

__all__ = ["RECONNECT_INTERVAL_S", "check_block_size", "checked_chunk_tokens", "server_link"]


def server_link(
    settings: KvringSettings,
    engine_id: str | None,
    on_connect: Callable[[Client], None],
    on_drop: Callable[[], None] | None = None,
) -> ServerLink:
    """This process's link to the server, logging as vLLM does."""
    return ServerLink(
        settings, engine_id, on_connect, on_drop, logger=logger, config_hint="kv_connector_extra_config"
    )


def checked_chunk_tokens(client: Client, settings: KvringSettings, expected: int | None) -> int:
    """The server's chunk size, refused when it differs from
    `kvring.chunk_tokens` or from the size this connector already uses."""
    chunk = int(client.server_config()["chunk_tokens"])
    want = expected if expected is not None else settings.chunk_tokens
    if want is not None and chunk != want:
        raise KvringError(
            f"the kvring server {settings.name!r} uses {chunk}-token chunks, but this engine "
            f"needs {want} (kvring.chunk_tokens); stop that server or drop the setting"
        )
    return chunk


def check_block_size(block_size: int, chunk_tokens: int) -> None:
    if chunk_tokens % block_size:
        raise KvringError(
            f"vLLM's block size {block_size} does not divide kvring's chunk size {chunk_tokens}: "
            "set kvring.chunk_tokens (for a new server) or vLLM's --block-size so that it does"
        )
