"""kvring's KV connector for vLLM (V1 connector API; run against vLLM 0.32,
written to follow 0.26 to 0.34 by feature tests).

Load it with one line::

    --kv-transfer-config '{"kv_connector":"KvringConnector",
                           "kv_connector_module_path":"kvring.vllm",
                           "kv_role":"kv_both"}'

and tune it with `kv_connector_extra_config` keys: `kvring.name` (server
name, default "default"), `kvring.autostart` (start a server of that name if
none runs, default true), `kvring.pool_bytes` and `kvring.chunk_tokens` (for
an autostarted server; a running server must have that chunk size),
`kvring.timeout_s` (deadline of a store, default 60),
`kvring.load_timeout_s` (deadline of a retrieve, default 5: what a load
may hold the forward waiting for it), `kvring.async_load` (default: as
vLLM schedules, see below), `kvring.layer_groups` (default 4: a load lands in that many
groups of layers, see below), `kvring.min_load_tokens` (a hit shorter than
this is recomputed, default 0),
`kvring.lookup_submit_s` (how long the scheduler waits for the server to
take a lookup, default 0.25: a stopped server costs the scheduler that once,
then lookups miss until it answers again), `kvring.lookup_wait_s` (how long
a request waits for a lookup's answer, default 3, the server's wait on its
second tier and some) and `kvring.runtime_dir`.

How vLLM's hooks map to kvring:

- scheduler: `get_num_new_matched_tokens` LOOKUPs the prompt's full chunks
  once per request (a lease holds the hits for every tensor-parallel rank)
  and answers the hit beyond vLLM's local prefix hit as a load.
  The lookup is submitted, not waited for: a hit in the pool is answered by
  the time the server takes it; one the server reads from its second tier
  is answered "not yet" (None), and the request waits in vLLM's queue while
  the scheduler goes on, until a later step finds the answer;
  `update_state_after_alloc` frees the holds on chunks that will not be
  loaded and plans the RETRIEVE; `build_connector_meta` ships the retrieves
  and the STOREs of newly complete prompt chunks to the workers;
  `request_finished` ends the lease (END_SESSION).
- worker: `register_kv_caches` registers the KV cache once (a host cache
  as the worker's own memory, a CUDA cache where torch or vLLM allocated
  it: a cudaMalloc block by IPC handle, VMM memory by POSIX fds);
  `start_load_kv` / `wait_for_save` submit RETRIEVE / STORE jobs (on a GPU,
  after an interprocess event recorded on the engine's stream, which the
  server polls from the host); `get_finished` and
  `get_block_ids_with_load_errors` report them from their job status in
  shared memory.

Where vLLM schedules synchronously, a load runs in the step that schedules
its request: the forward of that step waits for it, on a GPU on the device (the engine's
stream waits on the job's words, which the client library itself releases
at the load's deadline or when the server dies or stops, so the forward is
never held longer than `load_timeout_s`), on a CPU on the host. The server
lands the layers in `kvring.layer_groups` groups, one after another, and
each attention layer waits only for its own group (`wait_for_layer_load`),
so the forward of the first layers overlaps the copy of the later ones. A
step that vLLM replays as one full CUDA graph (no per-layer hooks) waits
for the whole load before its forward instead; a load whose layers were
not all waited for is reported failed (recomputed) and layer groups are
turned off. A
load that failed is reported in the same step and vLLM recomputes those
tokens, discarding the step's output for the request. Where vLLM schedules
asynchronously (its default on GPUs) the request instead waits in vLLM's
queue until its load is reported finished (a scheduler round trip later),
and the other requests of the batch never wait for it: vLLM has queued a
request's next step before it learns that a load in this one failed, and
that next step's token would reach the user (`KvringSettings.load_mode`).
`kvring.async_load=true` asks for this everywhere.

A failed or timed-out retrieve is reported as a load error, which vLLM
recomputes (the scheduler connector sets `kv_load_failure_policy` to
"recompute"); a lost server turns lookups into misses and loads into
failures at once, and is reconnected at most every second.

Hybrid models (vLLM's hybrid KV cache manager, `SupportsHMA`): each KV
cache group's chunks are objects of their own, stored and loaded with the
group's blocks; a sliding-window group loads only its window
(`kvring.vllm_cache_groups`, docs/vllm.md).

vLLM's scheduler and workers are separate (spawned) processes that import
this module by name; each has its own kvring client.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

import kvring
from kvring import Client, Job, KvringError, Lease, NoServer, PendingLookup, Registration
from kvring.vllm_cache_groups import CacheGroup, aliasing_error, cache_groups, load_span, slot_layers, storable_chunks
from kvring.tensors import (
    KvCacheMemory,
    KvCacheUnsupported,
    KvGeometry,
    describe_kv_caches,
    describe_opaque_blocks,
    register_kv_cache_memory,
)

try:  # vLLM 0.32 and later: a failed load reported per request.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None
_REPORTS_FAILED_LOADS = KVConnectorTransferResults is not None and "failed_recving" in getattr(
    KVConnectorTransferResults, "__dataclass_fields__", {}
)

try:  # vLLM 0.32 and later attribute external hits to a cache tier.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvring")

RECONNECT_INTERVAL_S = 1.0
"""While the server is gone, a new connection is tried at most this often:
every hook in between fails fast instead of waiting out a deadline."""

_FIRST_CONNECT_S = 1.0
_AUTOSTART_CONNECT_S = 10.0
# A server that accepts but does not answer (stopped) costs a reconnect
# attempt this long, once per RECONNECT_INTERVAL_S.
_RECONNECT_CONNECT_S = 0.05
_CALL_TIMEOUT_S = 5.0
_WARN_EVERY_S = 60.0

# Call failures that mean the server is gone or not answering: the
# connection is dropped so that later hooks fail fast.
_LINK_ERRORS = (kvring.ServerGone, kvring.ServerTimeout, kvring.ProtocolError)


# ---------------------------------------------------------------- settings


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
    min_load_tokens: int = 0
    lookup_submit_s: float = 0.25
    lookup_wait_s: float = 3.0
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
            "kvring.lookup_submit_s",
            "kvring.lookup_wait_s",
            "kvring.runtime_dir",
        }
        unknown = sorted(k for k in extra if k.startswith("kvring.") and k not in known)
        if unknown:
            raise KvringError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        chunk = extra.get("kvring.chunk_tokens")
        pool = extra.get("kvring.pool_bytes")
        runtime_dir = extra.get("kvring.runtime_dir")
        async_load = extra.get("kvring.async_load")
        settings = cls(
            name=str(extra.get("kvring.name", cls.name)),
            autostart=_as_bool("kvring.autostart", extra.get("kvring.autostart", cls.autostart)),
            pool_bytes=None if pool is None else str(pool),
            chunk_tokens=None if chunk is None else int(chunk),
            timeout_s=float(extra.get("kvring.timeout_s", cls.timeout_s)),
            load_timeout_s=float(extra.get("kvring.load_timeout_s", cls.load_timeout_s)),
            async_load=None if async_load is None else _as_bool("kvring.async_load", async_load),
            layer_groups=int(extra.get("kvring.layer_groups", cls.layer_groups)),
            min_load_tokens=int(extra.get("kvring.min_load_tokens", cls.min_load_tokens)),
            lookup_submit_s=float(extra.get("kvring.lookup_submit_s", cls.lookup_submit_s)),
            lookup_wait_s=float(extra.get("kvring.lookup_wait_s", cls.lookup_wait_s)),
            runtime_dir=None if runtime_dir is None else str(runtime_dir),
        )
        if settings.chunk_tokens is not None and settings.chunk_tokens <= 0:
            raise KvringError(f"kvring.chunk_tokens must be positive, not {settings.chunk_tokens}")
        if settings.layer_groups < 1:
            raise KvringError(f"kvring.layer_groups must be at least 1, not {settings.layer_groups}")
        if settings.min_load_tokens < 0:
            raise KvringError(f"kvring.min_load_tokens must not be negative, not {settings.min_load_tokens}")
        for key in ("timeout_s", "load_timeout_s", "lookup_submit_s", "lookup_wait_s"):
            if not getattr(settings, key) > 0:
                raise KvringError(f"kvring.{key} must be positive, not {getattr(settings, key)}")
        return settings

    def load_mode(self, async_scheduling: bool, cache_groups: int = 1) -> KvringSettings:
        """The settings with `async_load` decided for an engine that
        schedules asynchronously or not. With asynchronous scheduling vLLM
        queues a request's next step before it learns how this one went:
        a load that fails in its own step would have that next step's
        token, sampled from KV that never landed, given to the user (vLLM
        discards only the failed step's). So loads are asynchronous there
        (a failed one is known before the request runs), and a load in the
        step is refused as a setting. So it is for a model of several KV
        cache groups: vLLM can recompute a failed load of one only when the
        request waited for it."""
        if self.async_load is None:
            return replace(self, async_load=async_scheduling or cache_groups > 1)
        if not self.async_load and cache_groups > 1:
            raise KvringError(
                f"kvring.async_load=false: this model has {cache_groups} KV cache groups, and vLLM can "
                "recompute a failed load of such a model only when the request waited for it; "
                "leave kvring.async_load unset"
            )
        if not self.async_load and async_scheduling:
            raise KvringError(
                "kvring.async_load=false needs vLLM's synchronous scheduling (async_scheduling=False, "
                "--no-async-scheduling): with asynchronous scheduling a load that fails in its own step "
                "would give the user a token computed without its KV; leave kvring.async_load unset"
            )
        return self


def _as_bool(key: str, value: Any) -> bool:
    """A JSON bool, or the strings a command line gives (`true`, `0`, ...)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise KvringError(f"{key} must be true or false, not {value!r}")


# ---------------------------------------------------------------- identity


def engine_model_id(vllm_config: VllmConfig) -> tuple[int, str]:
    """The kvring model id of this engine's KV, and the text it hashes.

    Engines share stored chunks only when their KV bytes are interchangeable:
    same weights, KV dtype, per-rank heads, and the same object bytes. On a
    GPU an object holds each token's K and V rows whatever the engine's
    block size (`shm_layout.md`), so engines of different block sizes share
    objects. On a CPU a block is copied whole, as the attention kernel lays
    it out: the ISA vLLM picks decides its interior (K is stored transposed
    by the "vec" kernel, AMX packs differently) and so does the block size,
    so both are part of the id there.

    Computed from `vllm_config` alone, so the scheduler and every worker
    (separate processes) get the same id.
    """
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    parts = [
        "vllm-kv/2",
        f"model={mc.model}",
        f"revision={mc.revision}",
        f"quantization={mc.quantization}",
        f"kv_dtype={kv_dtype}",
        f"kv_heads={mc.get_num_kv_heads(pc)}",
        f"head_size={mc.get_head_size()}",
        f"mla={mc.use_mla}",
        f"platform={_platform_tag(vllm_config)}",
    ]
    if current_platform.is_cpu():
        parts.append(f"block={cc.block_size}")
    text = "|".join(parts)
    return kvring.model_id(text), text


def _platform_tag(vllm_config: VllmConfig) -> str:
    """The device type, plus on CPU the attention ISA that lays out blocks."""
    from vllm.platforms import current_platform

    tag = current_platform.device_type
    if current_platform.is_cpu():
        tag += f"/isa={_cpu_attention_isa(vllm_config)}"
    return tag


def _cpu_attention_isa(vllm_config: VllmConfig) -> str:
    """The ISA vLLM's CPU attention backend picks for this engine.

    The backend's chooser is private and its parameters changed across
    versions, so it is called with the parameters it declares; without it
    the CPU capability torch dispatches to stands in (coarser, still
    separating AVX-512 from AVX2 hosts).
    """
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        cpu_attn = None
    choose = getattr(cpu_attn, "_get_attn_isa", None)
    if choose is None:
        return f"torch-{torch.backends.cpu.get_cpu_capability()}"
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    args = {
        "dtype": mc.dtype,
        "block_size": cc.block_size,
        "head_size": mc.get_head_size(),
        "kv_cache_dtype": cc.cache_dtype,
    }
    params = inspect.signature(choose).parameters
    return str(choose(**{k: v for k, v in args.items() if k in params}))


def _world_size(vllm_config: VllmConfig) -> int:
    """Ranks that each hold a shard of every chunk: tensor x pipeline
    parallel (a LOOKUP hits only where every one of them stored it)."""
    pc = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, attr, 1) > 1:
            raise KvringError(f"kvring does not support {attr} > 1 (KV sharded by token)")
    return pc.tensor_parallel_size * pc.pipeline_parallel_size


def _request_salt(request: Request, group: CacheGroup) -> int:
    """The kvring salt of a request's chunks in one KV cache group: its cache
    salt and LoRA adapter, both of which change the KV of the same tokens,
    and the group (`CacheGroup.key`; none for a model of one group)."""
    parts = []
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_path', None) or lora.lora_name}")
    if group.key:
        parts.append(f"cache_group={group.key}")
    return kvring.salt_id("|".join(parts) if parts else None)


# ---------------------------------------------------------------- server link


_last_warning: dict[str, float] = {}


def _warn_throttled(key: str, msg: str, *args: object) -> None:
    """A warning at most every `_WARN_EVERY_S` per `key`: per-request
    failures must not flood the log."""
    now = time.monotonic()
    if now - _last_warning.get(key, -_WARN_EVERY_S) >= _WARN_EVERY_S:
        _last_warning[key] = now
        logger.warning(msg, *args)


def _start_server(settings: KvringSettings) -> str:
    """Starts a detached `kvring serve` for `settings.name`; returns its log.

    The server outlives vLLM (a new session, so vLLM's shutdown signals do
    not reach it). The scheduler and the workers may all start one at the
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


class _ServerLink:
    """One process's connection to the kvring server, for one connector.

    `client()` is what every hook asks for: the client, or None while the
    server is gone. A lost server is noticed from the connection (or a call
    failing with ServerGone / ServerTimeout) and reconnected at most every
    `RECONNECT_INTERVAL_S`, so hooks fail fast in between (an attempt costs
    at most the connect timeout, plus the call timeout of its first calls
    against a server that accepts but does not answer).
    `on_connect`
    readies each new client (the chunk size check; the worker's KV cache
    registration) and refuses it by raising KvringError.
    """

    def __init__(
        self,
        settings: KvringSettings,
        engine_id: str | None,
        on_connect: Callable[[Client], None],
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self._settings = settings
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
                    '"kvring.autostart": true in kv_connector_extra_config'
                ) from None
            log_path = _start_server(s)
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
            logger.error("kvring: the server %r is back but cannot be used: %s", self._settings.name, e)
            c.close()
            return None
        logger.warning("kvring: reconnected to the server %r", self._settings.name)
        self._client = c
        return c

    def failed(self, what: str, error: KvringError) -> None:
        """Notes a failed call: a gone or unresponsive server drops the
        connection; anything else is that one operation's failure."""
        if isinstance(error, _LINK_ERRORS) or (self._client is not None and self._client.server_gone):
            self._drop(f"{what}: {error}")
        else:
            _warn_throttled(what, "kvring: %s failed: %s", what, error)

    def _drop(self, reason: str) -> None:
        # The next `client()` tries once at once (a restarted server is
        # found without delay), then at most every RECONNECT_INTERVAL_S.
        c = self._client
        if c is None:
            return
        # Jobs are given up while their connection is still there: a server
        # that is slow, not dead, must not copy into blocks vLLM reuses.
        if self._on_drop is not None:
            self._on_drop()
        self._client = None
        logger.warning(
            "kvring: lost the server %r (%s); until it is back, lookups miss, loads fail "
            "(vLLM recomputes) and stores are skipped; retrying every %.0f s",
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


def _checked_chunk_tokens(client: Client, settings: KvringSettings, expected: int | None) -> int:
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


def _check_block_size(block_size: int, chunk_tokens: int) -> None:
    if chunk_tokens % block_size:
        raise KvringError(
            f"vLLM's block size {block_size} does not divide kvring's chunk size {chunk_tokens}: "
            "set kvring.chunk_tokens (for a new server) or vLLM's --block-size so that it does"
        )


# ---------------------------------------------------------------- metadata


@dataclass
class LoadOp:
    """Retrieve chunks `first_chunk ..` of a lease into `block_ids` (one per
    KV cache group of a request, all in the same step; whole
    chunks; the first `skip_tokens` tokens are vLLM's local prefix hit, or
    before a sliding window, and stay untouched). `lease_id` None: the scheduler already knows the load
    cannot happen; the worker reports it failed at once."""

    req_id: str
    lease_id: bytes | None
    first_chunk: int
    skip_tokens: int
    block_ids: list[int]
    sync: bool = True
    """In this step's forward (True), or reported in finished_recving."""


@dataclass
class StoreOp:
    """Store newly complete prompt chunks (`hashes`) from `block_ids`."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    salt: int
    windowed: bool = False
    """Of a sliding-window group, which frees blocks before the request
    ends: the next step's forward waits for it (`handle_preemptions`)."""


@dataclass
class KvringMetadata(KVConnectorMetadata):
    """One step's work for every worker (pickled into vLLM's SchedulerOutput):
    chunk keys and block ids, never token lists."""

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: the worker finishes their stores before
    their blocks are reused, and neither side waits for them at finish."""


# ---------------------------------------------------------------- stats

_STAT_KEYS = (
    "lookups",
    "lookups_given_up",
    "lookup_hit_tokens",
    "load_chunks",
    "load_failures",
    "load_wait_us",
    "load_layer_waits",
    "store_chunks",
    "store_failures",
)


@dataclass
class KvringStats(KVConnectorStats):
    """Counters of one logging interval: lookups and lookup hit tokens (those
    vLLM loads) from the scheduler; loads and stores in chunks from the
    workers, summed over them (every rank counts its own shard), and the
    time workers' hooks waited for loads of the step's forward
    (`load_wait_us`: on a GPU, what was left of the copies once the forward
    was queued), and the layer-group waits the forward made
    (`load_layer_waits`)."""

    def __post_init__(self) -> None:
        for key in _STAT_KEYS:
            self.data.setdefault(key, 0)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KvringStats | None:
        """This interval's counters (None if nothing happened); starts the next."""
        if self.is_empty():
            return None
        taken = KvringStats(data=dict(self.data))
        self.reset()
        return taken


# ---------------------------------------------------------------- scheduler


@dataclass
class _Tracked:
    """What the scheduler connector knows of one request."""

    hashes: list[bytes]
    salts: list[int]
    """The salt of its chunks' keys in each KV cache group."""
    looked_up: bool = False
    # The lookups (one per KV cache group) submitted and not all answered
    # yet, their answers so far, and when they were submitted.
    pending: list[PendingLookup] | None = None
    answers: dict[int, Lease] = field(default_factory=dict)
    pending_since: float = 0.0
    # One lease per KV cache group while they hold hits.
    leases: list[Lease] = field(default_factory=list)
    lease_client: Client | None = None
    hit_chunks: int = 0
    local_tokens: int = 0
    admitted: bool = False
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group: its block ids as vLLM announced them (positions a
    sliding-window group freed keep their old id: never stored from)."""
    stored_chunks: int = 0
    stores_issued: bool = False
    load_blocks: frozenset[int] = frozenset()
    load_failed: bool = False


class _SchedulerSide:
    """The scheduler role: lookups, leases, and each step's load and store plan."""

    def __init__(
        self, vllm_config: VllmConfig, settings: KvringSettings, model_id: int, groups: list[CacheGroup]
    ) -> None:
        cfg = vllm_config.kv_transfer_config
        self._settings = settings
        self._model_id = model_id
        self._groups = groups
        self._world_size = _world_size(vllm_config)
        self._loads_enabled = cfg.is_kv_consumer and bool(groups)
        self._stores_enabled = cfg.is_kv_producer and bool(groups)
        if len(groups) > 1 and not _REPORTS_FAILED_LOADS:
            # A failed load of a model of several groups cannot be reported
            # to this vLLM: it raises on block-level errors of such models
            # and has no per-request failure report.
            logger.warning(
                "kvring: this vLLM cannot be told of a failed load of a model of %d KV cache groups: "
                "kvring stores its KV but does not load it (vLLM 0.32 and later do)",
                len(groups),
            )
            self._loads_enabled = False
        self._block_size = vllm_config.cache_config.block_size
        if settings.chunk_tokens is not None:  # refused before a server is started for it
            _check_block_size(self._block_size, settings.chunk_tokens)
        self.chunk_tokens: int | None = None
        self._link = _ServerLink(settings, cfg.engine_id, self._on_connect)
        _check_block_size(self._block_size, self.chunk_tokens)
        self._blocks_per_chunk = self.chunk_tokens // self._block_size
        self._tracked: dict[str, _Tracked] = {}
        self._fresh_blocks: set[str] = set()
        self._pending_loads: list[LoadOp] = []
        # Requests whose load is planned and not reported finished yet.
        self._loading: set[str] = set()
        self.stats = KvringStats()

    def _on_connect(self, client: Client) -> None:
        self.chunk_tokens = _checked_chunk_tokens(client, self._settings, self.chunk_tokens)

    # -- lookup

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt's hit beyond vLLM's local `num_computed_tokens`, loaded
        asynchronously; None while its lookup is not answered (vLLM asks
        again at a later step). One LOOKUP per admission: vLLM asks again
        while a request waits, and gets the same lease's answer. Whole chunks only,
        and never the whole request (vLLM computes at least its last token)."""
        t = self._tracked.get(request.request_id)
        if t is None:
            t = self._track(request)
            if t is None:
                return 0, False
        if not self._loads_enabled or t.load_failed or getattr(request, "skip_reading_prefix_cache", False):
            # After a failed load the request is recomputed: its old answer
            # must not be replayed (the load would fail again, forever).
            return 0, False
        if t.admitted:
            # Asked again after an allocation: preempted and re-admitted. The
            # retrieve consumed or freed the old holds; look up afresh. Its
            # old blocks are someone else's now.
            self._end_lease(t)
            self._loading.discard(request.request_id)
            t.load_blocks = frozenset()
            t.admitted = False
            t.looked_up, t.hit_chunks = False, 0
        client = self._link.client()
        if (t.leases or t.pending is not None) and t.lease_client is not client:
            t.leases, t.lease_client, t.pending, t.answers = [], None, None, {}
            t.looked_up, t.hit_chunks = False, 0
        if not t.looked_up:
            if client is None:
                return 0, False
            if t.pending is None:
                self._submit_lookup(client, t)
            if t.pending is not None and not self._poll_lookup(t):
                # Not answered yet: the request waits, the scheduler goes on.
                return None, False
        usable = min(t.hit_chunks, (request.num_tokens - 1) // self.chunk_tokens)
        t.local_tokens = num_computed_tokens
        external = usable * self.chunk_tokens - num_computed_tokens
        if external <= 0 or external < self._settings.min_load_tokens:
            return 0, False
        return external, self._settings.async_load

    def _track(self, request: Request) -> _Tracked | None:
        """State for a request kvring can serve: a token prompt (multimodal
        placeholders and embeddings do not key their KV) of one full chunk
        or more."""
        if request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return None
        hashes = kvring.chunk_hashes(request.prompt_token_ids, self.chunk_tokens)
        if not hashes:
            return None
        t = _Tracked(hashes=hashes, salts=[_request_salt(request, g) for g in self._groups])
        self._tracked[request.request_id] = t
        return t

    def _submit_lookup(self, client: Client, t: _Tracked) -> None:
        """Submits the request's LOOKUP (the server must take it within
        `lookup_submit_s`); a failure is a miss."""
        self.stats.count("lookups")
        pending: list[PendingLookup] = []
        try:
            for salt in t.salts:
                pending.append(
                    client.submit_lookup(
                        self._model_id,
                        self._world_size,
                        t.hashes,
                        salt=salt,
                        timeout=self._settings.lookup_submit_s,
                    )
                )
        except KvringError as e:
            for p in pending:
                p.cancel()
            self._link.failed("lookup", e)
            t.looked_up = True
            return
        t.pending, t.answers = pending, {}
        t.pending_since = time.monotonic()
        t.lease_client = client

    def _poll_lookup(self, t: _Tracked) -> bool:
        """Whether the pending lookup has an answer now (a lease, or a miss:
        failed, or not answered within `lookup_wait_s`)."""
        assert t.pending is not None
        try:
            for i, p in enumerate(t.pending):
                if i not in t.answers:
                    lease = p.poll()
                    if lease is not None:
                        t.answers[i] = lease
        except KvringError as e:
            self._forget_lookup(t)
            self._link.failed("lookup", e)
            return True
        if len(t.answers) < len(t.pending):
            if time.monotonic() - t.pending_since < self._settings.lookup_wait_s:
                return False
            # Given up: a miss (the leases of lookups answered later are
            # ended once they are).
            self._forget_lookup(t)
            self.stats.count("lookups_given_up")
            return True
        leases = [t.answers[i] for i in range(len(t.pending))]
        t.pending, t.answers = None, {}
        self._answered(t, leases)
        return True

    def _forget_lookup(self, t: _Tracked) -> None:
        """A miss: the lookups not answered are cancelled; the leases of
        those answered are dropped (their ends queued)."""
        for i, p in enumerate(t.pending or ()):
            if i not in t.answers:
                p.cancel()
        t.pending, t.answers, t.lease_client, t.looked_up = None, {}, None, True

    def _answered(self, t: _Tracked, leases: list[Lease]) -> None:
        """A hit is the chunks every KV cache group has."""
        t.looked_up = True
        t.hit_chunks = min(lease.hits for lease in leases)
        # Chunks present for every rank need no store.
        t.stored_chunks = max(t.stored_chunks, t.hit_chunks)
        if t.hit_chunks:
            t.leases = leases
        else:
            t.lease_client = None
        # A lease dropped holds nothing more: dropping it queues its end
        # with the client's next call.

    # -- allocation

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Records the request's blocks; at admission also plans the load and
        frees the holds on hit chunks that will not be loaded (vLLM has them
        locally, or they would cover the whole prompt)."""
        t = self._tracked.get(request.request_id)
        if t is None:
            return
        t.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self._fresh_blocks.add(request.request_id)
        if t.admitted:
            return  # The second call, once an asynchronous load is done.
        t.admitted = True
        if num_external_tokens <= 0:
            self._end_lease(t)
            return
        c = self.chunk_tokens
        start = t.local_tokens
        end = start + num_external_tokens
        client = self._link.client()
        usable = end % c == 0 and len(t.leases) == len(self._groups) and t.lease_client is client
        ops: list[LoadOp] = []
        for g, lease in zip(self._groups, t.leases if usable else [None] * len(self._groups), strict=True):
            # From the first block the group holds: a sliding-window group
            # holds only its window's blocks before the first token to compute.
            span = load_span(t.block_ids[g.index], start, end, self._block_size, c)
            if span is None:
                # Blocks laid out as this connector does not expect (the
                # group holds the block of the last token to load): the
                # load fails and vLLM recomputes the request.
                lease = None
                bpc = self._blocks_per_chunk
                span = (start // c, start % c, t.block_ids[g.index][start // c * bpc : -(-end // c) * bpc])
            first, skip, ids = span
            ops.append(
                LoadOp(
                    req_id=request.request_id,
                    lease_id=None if lease is None else lease.id,
                    first_chunk=first,
                    skip_tokens=skip,
                    block_ids=ids,
                    sync=not self._settings.async_load,
                )
            )
            if lease is not None:
                self._release_unloaded(client, lease, first, end // c)
        self.stats.count("lookup_hit_tokens", num_external_tokens)
        t.load_blocks = frozenset(b for op in ops for b in op.block_ids[op.skip_tokens // self._block_size :])
        # Until finished_recving (asynchronous), or (in the step's forward)
        # until the request ends: its blocks are its own till then, so an
        # invalid one can only come from this load.
        self._loading.add(request.request_id)
        self._pending_loads.extend(ops)

    def _release_unloaded(self, client: Client, lease: Lease, first: int, last: int) -> None:
        """Frees the lease's holds outside chunks first..last-1 now rather
        than at the request's end."""
        try:
            if first > 0:
                client.release_lease_chunks(lease.id, 0, first)
            if lease.hits > last:
                client.release_lease_chunks(lease.id, last, lease.hits - last)
        except KvringError as e:
            self._link.failed("release_lease_chunks", e)

    def _end_lease(self, t: _Tracked) -> None:
        """END_SESSION: frees whatever the leases still hold."""
        leases, t.leases = t.leases, []
        if t.lease_client is self._link.current:
            for lease in leases:
                try:
                    lease.end()
                except KvringError as e:
                    self._link.failed("end_lease", e)
                    break
        t.lease_client = None

    # -- each step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvringMetadata:
        """This step's loads (planned at allocation) and the stores of prompt
        chunks that this step's forward completes."""
        meta = KvringMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            # Its stores so far are waited for by the workers before the
            # blocks are reused (handle_preemptions), not at its finish.
            t = self._tracked.get(req_id)
            if t is not None:
                t.stores_issued = False
        scheduled = scheduler_output.num_scheduled_tokens
        store = self._stores_enabled and self._link.client() is not None
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [list(ids) for ids in new.block_ids]
                if store:
                    self._plan_store(meta, new.req_id, t, new.num_computed_tokens, scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            # A request allocated through update_state_after_alloc this step
            # (resumed) has its whole block list already.
            if new_block_ids is not None and req_id not in self._fresh_blocks:
                if len(t.block_ids) != len(new_block_ids):
                    # Blocks of a request whose earlier ones this connector
                    # never saw: their positions are unknown, so nothing of
                    # it is stored.
                    t.block_ids = [[] for _ in new_block_ids]
                    t.stored_chunks = len(t.hashes)
                for ids, more in zip(t.block_ids, new_block_ids, strict=True):
                    ids.extend(more)
            if store:
                self._plan_store(meta, req_id, t, cached.num_computed_tokens[i], scheduled[req_id])
        self._fresh_blocks.clear()
        return meta

    def _plan_store(self, meta: KvringMetadata, req_id: str, t: _Tracked, before: int, scheduled: int) -> None:
        """Stores the chunks this step completes (it computes `scheduled`
        tokens after `before`), in every KV cache group; where a
        sliding-window group no longer holds a chunk's first blocks (a
        chunked prefill that moved past its window), the request stores
        nothing more (a hit needs its chunks in every group)."""
        first = t.stored_chunks
        complete = min((before + scheduled) // self.chunk_tokens, len(t.hashes))
        if complete <= first:
            return
        bpc = self._blocks_per_chunk
        n = min(storable_chunks(g, first, complete, before, self._block_size, self.chunk_tokens) for g in self._groups)
        if n > 0:
            for g in self._groups:
                meta.stores.append(
                    StoreOp(
                        req_id=req_id,
                        hashes=t.hashes[first : first + n],
                        block_ids=t.block_ids[g.index][first * bpc : (first + n) * bpc],
                        salt=t.salts[g.index],
                        windowed=g.window is not None,
                    )
                )
            t.stores_issued = True
        t.stored_chunks = complete if n == complete - first else len(t.hashes)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Notes failed loads, so that the request's next lookup answers no
        hit (vLLM resets a request whose load failed and asks again).

        With several ranks, one rank's failed blocks may come back steps
        before the load is finished on every rank (vLLM merges invalid
        blocks as they come, finished loads once all ranks report them), so
        every load still in flight is checked against every step's invalid
        blocks, and forgotten only once it finished."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        if invalid or failed:
            for req_id in list(self._loading):
                t = self._tracked.get(req_id)
                if t is None:
                    self._loading.discard(req_id)
                elif req_id in failed or not invalid.isdisjoint(t.load_blocks):
                    if not t.load_failed:
                        _warn_throttled("load", "kvring: a load failed (request %s); vLLM recomputes it", req_id)
                    t.load_failed = True
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            t = self._tracked.get(req_id)
            if t is not None:
                t.load_blocks = frozenset()

    def request_finished(self, request: Request) -> bool:
        """Ends the lease; True (keep the blocks) when stores were issued for
        the request since its last preemption: the workers report them in
        finished_sending once their jobs end. (The scheduler cannot see job
        completion, so any issued store counts as in flight.)"""
        t = self._tracked.pop(request.request_id, None)
        self._loading.discard(request.request_id)
        if t is None:
            return False
        if t.pending is not None:
            # Not all answered: the leases of the others are ended once
            # they are.
            self._forget_lookup(t)
        self._end_lease(t)
        return t.stores_issued

    def reset_cache(self) -> bool:
        client = self._link.client()
        if client is None:
            return False
        try:
            client.clear()
        except KvringError as e:
            self._link.failed("clear", e)
            return False
        return True

    def shutdown(self) -> None:
        """Closing the connection ends every lease still held."""
        self._tracked.clear()
        self._link.close()


# ---------------------------------------------------------------- worker


@dataclass
class _Transfer:
    """A submitted STORE or RETRIEVE: its job, its deadline, its size, and
    (for a retrieve) the blocks that are invalid if it fails."""

    job: Job
    deadline: float
    chunks: int
    block_ids: list[int] = field(default_factory=list)
    event: Any = None
    """The engine event the server's copies wait for (a GPU cache), kept
    alive until the job is over."""
    outcome: bool | None = None
    """Once known: done (True) or failed; its job is released then. A
    step's stores share one STORE, and so one transfer."""
    groups: int = 1
    """A load in layer groups: the forward waits for each group at its
    first layer (`wait_for_layer_load`)."""
    next_group: int = 0
    """The first group not waited for yet."""

    def settle(self, ok: bool, stats: KvringStats) -> None:
        """Records the outcome once (the job released, the chunks counted)."""
        if self.outcome is None:
            self.outcome = ok
            _release(self.job)
            self.event = None
            if ok:
                stats.count("store_chunks", self.chunks)
            else:
                stats.count("store_failures")


class _WorkerSide:
    """The worker role: the KV cache registration and the jobs of each step."""

    def __init__(
        self, vllm_config: VllmConfig, settings: KvringSettings, model_id: int, groups: list[CacheGroup]
    ) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self._settings = settings
        self._model_id = model_id
        self._cache_groups = groups
        self._world_size = _world_size(vllm_config)
        self._rank = get_pp_group().rank_in_group * pc.tensor_parallel_size + get_tensor_model_parallel_rank()
        self._block_size = vllm_config.cache_config.block_size
        self._mla = bool(mc.use_mla)
        head_size = mc.get_head_size()
        self._geometry = KvGeometry(
            block_tokens=self._block_size,
            heads=1 if self._mla else mc.get_num_kv_heads(pc),
            k_width=head_size,
            v_width=0 if self._mla else head_size,
        )
        self._memory: KvCacheMemory | None = None
        self._registration: Registration | None = None
        # Each registered layer's group for this worker's layer groups
        # (`kvring.layer_groups`, at most one per layer), by layer name.
        self._layer_group: dict[str, int] = {}
        self._groups = 1
        if settings.chunk_tokens is not None:  # refused before a server is started for it
            _check_block_size(self._block_size, settings.chunk_tokens)
        self.chunk_tokens: int | None = None
        # Asynchronous loads by request: one per KV cache group.
        self._loads: dict[str, list[_Transfer]] = {}
        # Loads in this step's forward, settled in get_block_ids_with_load_errors.
        self._step_loads: dict[str, _Transfer] = {}
        # Those of them the forward waits for layer group by layer group.
        self._layered: list[_Transfer] = []
        # The engine's streams that wait on loads, by CUDA stream handle.
        self._streams: dict[int, Any] = {}
        self._stores: dict[str, list[_Transfer]] = {}
        self._link = _ServerLink(
            settings, vllm_config.kv_transfer_config.engine_id, self._on_connect, self._abandon_jobs
        )
        _check_block_size(self._block_size, self.chunk_tokens)
        # Requests with stores since their last preemption: the scheduler
        # keeps their blocks after they finish until this rank reports them
        # in finished_sending.
        self._store_reqs: set[str] = set()
        self._finished_with_stores: set[str] = set()
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        # Stores of sliding-window groups not known to have ended: the next
        # step's forward waits for them (`handle_preemptions`).
        self._fence: list[_Transfer] = []
        self.stats = KvringStats()

    def _on_connect(self, client: Client) -> None:
        self.chunk_tokens = _checked_chunk_tokens(client, self._settings, self.chunk_tokens)
        if self._memory is not None:
            self._registration = self._register(client)

    def _register(self, client: Client) -> Registration:
        return register_kv_cache_memory(
            client, self._memory, model_id=self._model_id, world_size=self._world_size, rank=self._rank
        )

    # -- registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the KV cache once: one kvring allocation per backing
        storage, one placement per layer, sizes and strides from the tensors.
        With several KV cache groups, their shared pages once: the layers of
        the largest group (`kvring.vllm_cache_groups`)."""
        if not self._cache_groups:
            return  # not cached (said at start)
        if len(self._cache_groups) > 1:
            slots = slot_layers(self._cache_groups, list(kv_caches))
            views = {
                name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                for name, t in kv_caches.items()
                if isinstance(t, torch.Tensor)
            }
            error = aliasing_error(self._cache_groups, slots, views)
            if error:
                logger.warning("kvring: this model's KV is not cached: %s", error)
                self._cache_groups = []
                return
            kv_caches = {name: kv_caches[name] for name in slots}
        first = next(iter(kv_caches.values()), None)
        memory = None
        if first is not None and first.device.type == "cpu" and not self._mla:
            # The CPU attention kernel's block interior is its own (and the
            # engine id names its ISA): blocks are copied as opaque bytes,
            # one run each, where each block is one run.
            with contextlib.suppress(KvCacheUnsupported):
                memory = describe_opaque_blocks(kv_caches, self._geometry)
        if memory is None:
            memory = describe_kv_caches(kv_caches, self._geometry, shared=self._mla)
        memory.layout.validate(self.chunk_tokens)
        self._memory = memory
        layers = memory.layout.layers
        # One group per layer at most; none where the names do not map one
        # to one onto the layout's layers.
        self._groups = min(self._settings.layer_groups, layers) if len(kv_caches) == layers else 1
        # Group k of G over L layers: layers k*L//G .. (k+1)*L//G (the
        # split the server lands them in).
        self._layer_group = {
            name: ((i + 1) * self._groups - 1) // layers for i, name in enumerate(kv_caches)
        }
        client = self._link.client()
        if client is None:
            logger.warning("kvring: no server to register the KV cache with yet; registering at reconnect")
            return
        self._registration = self._register(client)
        logger.info(
            "kvring: registered rank %d/%d: %d layers x %d blocks of %d tokens, %d allocation(s), %.1f MiB",
            self._rank,
            self._world_size,
            memory.layout.layers,
            memory.layout.blocks,
            memory.layout.block_tokens,
            len(memory.addresses),
            sum(memory.layout.allocations) / 2**20,
        )

    def unregister_kv_caches(self) -> None:
        """Sleep / weight update (vLLM 0.33+): the memory may change, so
        nothing may copy into it from here on."""
        self._abandon_jobs()
        reg, self._registration = self._registration, None
        client = self._link.current
        if reg is not None and client is not None:
            try:
                client.unregister(reg)
            except KvringError as e:
                self._link.failed("unregister", e)

    def restore_kv_caches(self) -> None:
        client = self._link.client()
        if self._memory is not None and self._registration is None and client is not None:
            self._registration = self._register(client)

    # -- jobs

    def engine_event(self) -> tuple[Any, bytes | None]:
        """For a GPU cache: an interprocess event recorded now on the
        engine's current stream, and its handle (the server's copies wait
        for it, polled from the host: the engine's work queued so far on
        the blocks comes first). For a host cache (None, None): a CPU
        forward is over when the hook runs."""
        if self._memory is None or self._memory.device.type != "cuda":
            return None, None
        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream(self._memory.device))
        return ev, bytes(ev.ipc_handle())

    def start_load_kv(self, meta: KvringMetadata, per_layer: bool = True) -> None:
        """Submits this step's retrieves, after the work the engine queued
        so far (a GPU cache's blocks may still be read by an earlier step);
        failures are reported at once. The forward waits for the loads of
        this step, each bounded by the load's deadline: layer group by layer
        group in `wait_for_layer_load` (unless `per_layer` is false: vLLM
        replays the step as one CUDA graph, without per-layer hooks), else
        before the forward (on a GPU its stream waits on the device, on a
        CPU this hook waits)."""
        client, reg = self._link.client(), self._registration
        event, after = self.engine_event() if meta.loads and client is not None and reg is not None else (None, None)
        timeout = self._settings.load_timeout_s
        groups = self._groups if per_layer else 1
        waiting: list[_Transfer] = []
        for op in meta.loads:
            invalid = op.block_ids[op.skip_tokens // self._block_size :]
            if op.lease_id is None or client is None or reg is None:
                self._load_failed(op.req_id, invalid, op.sync)
                continue
            layered = op.sync and groups > 1
            try:
                job = client.retrieve(
                    reg,
                    op.lease_id,
                    op.block_ids,
                    first_chunk=op.first_chunk,
                    skip_tokens=op.skip_tokens,
                    timeout=timeout,
                    after=after,
                    layer_groups=groups if layered else 1,
                )
            except KvringError as e:
                self._link.failed("retrieve", e)
                client = self._link.current
                self._load_failed(op.req_id, invalid, op.sync)
                continue
            chunks = len(op.block_ids) * self._block_size // self.chunk_tokens
            tr = _Transfer(job, time.monotonic() + timeout, chunks, invalid, event=event)
            if not op.sync:
                self._loads.setdefault(op.req_id, []).append(tr)
                continue
            self._step_loads[op.req_id] = tr
            if layered:
                tr.groups = groups
                self._layered.append(tr)
                continue
            if event is None:
                waiting.append(tr)
                continue
            try:
                self._engine_stream().wait_job(job)
            except KvringError as e:
                # Not queued: the forward must not read these blocks' old
                # contents as this load's.
                logger.warning("kvring: the engine's stream cannot wait for a load (%s): it fails", e)
                _give_up(job)
                tr.outcome = False
        for tr in waiting:
            tr.outcome = self._await(tr)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before attention layer `layer_name` runs: the forward waits until
        its layer group of each of this step's loads landed (a layer the
        registration does not name waits for the whole load). On a GPU the
        engine's stream waits on the device, on a CPU this call waits; both
        end at the load's deadline at the latest."""
        if not self._layered:
            return
        for tr in self._layered:
            group = self._layer_group.get(layer_name, tr.groups - 1)
            if group < tr.next_group or tr.outcome is not None:
                continue
            tr.next_group = group + 1
            self.stats.count("load_layer_waits")
            try:
                if tr.event is not None:
                    self._engine_stream().wait_layer_group(tr.job, group)
                else:
                    t0 = time.perf_counter()
                    tr.job.wait_layer_group(group, timeout=max(0.0, tr.deadline - time.monotonic()))
                    self.stats.count("load_wait_us", int((time.perf_counter() - t0) * 1e6))
            except KvringError as e:
                # Not waited for: the forward may read these blocks before
                # they landed, so the load fails (given up: nothing of it
                # lands afterwards) and vLLM recomputes the request.
                logger.warning("kvring: the forward cannot wait for a load's layers (%s): it fails", e)
                _give_up(tr.job)
                tr.outcome = False

    def _await(self, tr: _Transfer) -> bool:
        t0 = time.perf_counter()
        ok = _await(tr)
        self.stats.count("load_wait_us", int((time.perf_counter() - t0) * 1e6))
        return ok

    def _engine_stream(self) -> Any:
        """The kvring handle of the engine's current CUDA stream (one per
        stream, kept for the worker's life)."""
        stream = torch.cuda.current_stream(self._memory.device)
        handle = stream.cuda_stream
        es = self._streams.get(handle)
        if es is None:
            es = kvring.EngineStream(stream.device.index, handle)
            self._streams[handle] = es
        return es

    def submit_stores(self, ops: list[StoreOp]) -> None:
        """Submits a step's stores as one STORE per salt (chunk keys are
        independent: one request to the server instead of one per vLLM
        request, so the server wakes once per step), ordered after the
        forward the engine queued (`engine_event`)."""
        client, reg = self._link.client(), self._registration
        event, after = self.engine_event() if client is not None and reg is not None else (None, None)
        by_salt: dict[int, list[StoreOp]] = {}
        for op in ops:
            self._store_reqs.add(op.req_id)
            by_salt.setdefault(op.salt, []).append(op)
        if client is None or reg is None:
            return
        for salt, group in by_salt.items():
            hashes = [h for op in group for h in op.hashes]
            blocks = [b for op in group for b in op.block_ids]
            # The next forward waits for a sliding-window group's store
            # (`_wait_fence`): it gets a load's deadline, not a store's.
            windowed = any(op.windowed for op in group)
            timeout = self._settings.load_timeout_s if windowed else self._settings.timeout_s
            try:
                job = client.store(reg, hashes, blocks, timeout=timeout, salt=salt, after=after)
            except KvringError as e:
                self._link.failed("store", e)
                self.stats.count("store_failures")
                client = self._link.current
                if client is None:
                    return
                continue
            shared = _Transfer(job, time.monotonic() + timeout, len(hashes), event=event)
            for op in group:
                self._stores.setdefault(op.req_id, []).append(shared)
            if windowed:
                self._fence.append(shared)

    def handle_preemptions(self, meta: KvringMetadata) -> None:
        """Preempted requests' blocks are reused from this step on: their
        stores must end first (each bounded by its deadline)."""
        for req_id in meta.preempted:
            self._store_reqs.discard(req_id)
            self._finished_with_stores.discard(req_id)
            for tr in self._stores.pop(req_id, ()):
                if tr.outcome is not None:
                    continue
                try:
                    ok = tr.job.wait(timeout=max(0.0, tr.deadline - time.monotonic())).ok
                except kvring.ServerTimeout:
                    _give_up(tr.job)
                    ok = False
                except KvringError:
                    ok = False
                tr.settle(ok, self.stats)
        self._wait_fence()

    def _wait_fence(self) -> None:
        """Before this step's forward: the stores of sliding-window groups
        issued in earlier steps end first, since vLLM frees the blocks that
        leave a window while the request runs and may give them to this
        step's tokens. On a GPU the engine's stream waits on the device, on
        a CPU this hook waits; either way no longer than the store's
        deadline, `kvring.load_timeout_s` (a store given up copies nothing
        more)."""
        fence, self._fence = self._fence, []
        for tr in fence:
            if tr.outcome is not None or tr.job.released:
                continue
            if tr.event is not None:
                try:
                    self._engine_stream().wait_job(tr.job)
                    continue
                except KvringError as e:
                    logger.warning("kvring: the engine's stream cannot wait for a store (%s): it is given up", e)
                    _give_up(tr.job)
                    continue
            try:
                tr.job.wait(timeout=max(0.0, tr.deadline - time.monotonic()))
            except KvringError:
                _give_up(tr.job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished loads (failed ones too: vLLM must unpark them) and the
        finished requests whose stores all ended, from job status reads."""
        alive = self._link.client() is not None
        self._poll_loads(alive)
        self._poll_stores(alive)
        self._finished_with_stores.update(r for r in finished_req_ids if r in self._store_reqs)
        sending = {r for r in self._finished_with_stores if r not in self._stores}
        self._finished_with_stores -= sending
        self._store_reqs -= sending
        recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def take_failed_recving(self) -> set[str]:
        """The requests of a model of several KV cache groups whose
        (asynchronous) load failed since the last call: vLLM recomputes
        them whole."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads. The loads of this step's forward are
        settled here (waiting, bounded by their deadline, for those the
        forward still waits on the device): vLLM must learn of a failure in
        the step's own output, before it samples from the KV. Polls the
        others too, so a failure's blocks are never reported after its
        request appears in finished_recving, whatever order a vLLM version
        calls the two in."""
        for tr in self._layered:
            if tr.outcome is None and tr.next_group < tr.groups:
                # The forward did not wait for every layer group (vLLM ran
                # some layers without the per-layer hook): it may have read
                # blocks before they landed. Recomputed; whole loads from
                # now on.
                logger.warning(
                    "kvring: vLLM ran layers of a load without waiting for them (%d of %d layer groups "
                    "waited for); the request is recomputed and loads are waited for whole from now on",
                    tr.next_group,
                    tr.groups,
                )
                self._groups = 1
                _give_up(tr.job)
                tr.outcome = False
        self._layered.clear()
        for req_id, tr in self._step_loads.items():
            ok = tr.outcome if tr.outcome is not None else self._await(tr)
            _release(tr.job)
            tr.event = None
            if ok:
                self.stats.count("load_chunks", tr.chunks)
            else:
                self._load_failed(req_id, tr.block_ids, True)
        self._step_loads.clear()
        self._poll_loads(self._link.current is not None)
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _poll_loads(self, alive: bool) -> None:
        for req_id, transfers in list(self._loads.items()):
            for tr in transfers:
                if tr.outcome is None:
                    tr.outcome = _outcome(tr, alive)
            if any(tr.outcome is None for tr in transfers):
                continue
            del self._loads[req_id]
            for tr in transfers:
                _release(tr.job)
            if all(tr.outcome for tr in transfers):
                self.stats.count("load_chunks", sum(tr.chunks for tr in transfers))
                self._recving.add(req_id)
            else:
                self._load_failed(req_id, [b for tr in transfers for b in tr.block_ids])

    def _load_failed(self, req_id: str, block_ids: Iterable[int], sync: bool = False) -> None:
        """Reports a failed load: its blocks, and (an asynchronous one) its
        end, so that vLLM unparks the request."""
        self.stats.count("load_failures")
        if not sync:
            self._recving.add(req_id)
        if len(self._cache_groups) > 1:
            # vLLM refuses block-level errors for a model of several KV
            # cache groups: the request is reported failed (asynchronous
            # loads only, `KvringSettings.load_mode`) and recomputed whole.
            self._failed_recving.add(req_id)
        else:
            self._failed_blocks.update(block_ids)

    def _poll_stores(self, alive: bool) -> None:
        for req_id, transfers in list(self._stores.items()):
            running = []
            for tr in transfers:
                if tr.outcome is None:
                    ok = _outcome(tr, alive)
                    if ok is None:
                        running.append(tr)
                        continue
                    tr.settle(ok, self.stats)
            if running:
                self._stores[req_id] = running
            else:
                del self._stores[req_id]

    def _abandon_jobs(self) -> None:
        """Gives up every job still running (no copy of it lands afterwards)
        and counts it failed: loads are reported as load errors."""
        for req_id, transfers in list(self._loads.items()):
            for tr in transfers:
                _give_up(tr.job)
                _release(tr.job)
            self._load_failed(req_id, [b for tr in transfers for b in tr.block_ids])
        self._loads.clear()
        for tr in self._step_loads.values():
            if tr.outcome is None:
                _give_up(tr.job)
                tr.outcome = False
        self._layered.clear()
        for transfers in self._stores.values():
            for tr in transfers:
                if tr.outcome is None:
                    _give_up(tr.job)
                    tr.settle(False, self.stats)
        self._stores.clear()

    def shutdown(self) -> None:
        """Gives up what is still running and closes the connection (the
        server unregisters the KV cache with it)."""
        self._abandon_jobs()
        for es in self._streams.values():
            es.close()
        self._streams.clear()
        self._link.close()


def _outcome(tr: _Transfer, alive: bool) -> bool | None:
    """True: done; False: failed, timed out, or its server is gone (given up
    first, so no copy lands later); None: still running. Never waits."""
    try:
        st = tr.job.status()
    except KvringError:
        return False
    if st.finished:
        return st.ok
    if alive and time.monotonic() < tr.deadline:
        return None
    _give_up(tr.job)
    return False


def _await(tr: _Transfer) -> bool:
    """Waits for a load the forward needs: done (True), or failed, past its
    deadline or its server gone (given up first: no copy of it lands
    afterwards)."""
    try:
        return tr.job.wait(timeout=max(0.0, tr.deadline - time.monotonic())).ok
    except KvringError:
        _give_up(tr.job)
        return False


def _give_up(job: Job) -> None:
    with contextlib.suppress(KvringError):
        job.give_up()


def _release(job: Job) -> None:
    with contextlib.suppress(KvringError):
        job.release()


# ---------------------------------------------------------------- connector


def _ensure_recompute_policy(cfg: KVTransferConfig) -> None:
    """A failed load must end in recompute, not in a failed request: vLLM
    0.32 defaults `kv_load_failure_policy` to "fail". The scheduler reads the
    policy right after constructing its connector, so setting it here, in
    the config this connector is handed, takes effect."""
    if getattr(cfg, "kv_load_failure_policy", "recompute") != "recompute":
        logger.warning(
            "kvring: set kv_load_failure_policy to 'recompute' (was %r): a failed kvring load "
            "is recomputed, never an error",
            cfg.kv_load_failure_policy,
        )
        cfg.kv_load_failure_policy = "recompute"


class KvringConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a node-local kvring server (see the module
    docstring). One instance per role and process. It serves vLLM's hybrid
    KV cache manager (`SupportsHMA`): the KV cache groups of
    `kvring.vllm_cache_groups`."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = KvringSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        groups, unsupported = cache_groups(kv_cache_config)
        if unsupported:
            logger.warning("kvring: this model's KV is not cached: %s", unsupported)
        settings = settings.load_mode(
            bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)), len(groups)
        )
        model_id, identity = engine_model_id(vllm_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _ensure_recompute_policy(self._kv_transfer_config)
            self._scheduler = _SchedulerSide(vllm_config, settings, model_id, groups)
            chunk = self._scheduler.chunk_tokens
        else:
            self._worker = _WorkerSide(vllm_config, settings, model_id, groups)
            chunk = self._worker.chunk_tokens
        logger.info(
            "kvring: %s connector on server %r, %d-token chunks, model id %016x (%s)",
            role.name.lower(),
            settings.name,
            chunk,
            model_id,
            identity,
        )

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
        """vLLM 0.34+: the server maps a GPU KV cache from POSIX fds (VMM
        memory, so vLLM's extensible KV cache stays on) or from legacy IPC
        handles (cudaMalloc memory); either way it is another process."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.EXPORTS_FD

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a store lost to a preemption is a later miss,
        never a reason to recompute the request."""
        return False

    # -- scheduler hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of `request_finished` on a connector with
        `SupportsHMA`, whether the model has one KV cache group or several."""
        return self._scheduler.request_finished(request), None

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # -- worker hooks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KvringMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvringMetadata):
            # A step replayed as one full CUDA graph runs no per-layer hook.
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            self._worker.start_load_kv(meta, per_layer=getattr(mode, "name", None) != "FULL")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores are whole chunks after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Submits this step's stores without waiting for them: the scheduler
        keeps a finished request's blocks until its stores are reported. On
        a GPU the copies wait for an event recorded after the forward
        queued on the engine's stream; the engine never waits here."""
        meta = self._connector_metadata
        if isinstance(meta, KvringMetadata) and meta.stores:
            self._worker.submit_stores(meta.stores)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+: `get_finished`, and the failed loads of a model of
        several KV cache groups (each also among the finished ones)."""
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self._worker.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # -- both roles

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvringStats(data=dict(data or {}))

    def shutdown(self) -> None:
        (self._scheduler or self._worker).shutdown()
