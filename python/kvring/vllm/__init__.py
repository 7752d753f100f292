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
this is recomputed; default 1,280 on a GPU engine without CUDA graphs,
where a shorter hit was measured slower than recomputing, else 0),
`kvring.submit_s` (how long a hook waits for the server to take a lookup,
a store or a retrieve, default 0.25: a stopped server costs a step that
once, then lookups miss and stores are skipped until it answers again;
`kvring.lookup_submit_s` is its earlier name), `kvring.lookup_wait_s` (how long
a request waits for a lookup's answer, default 3, the server's wait on its
second tier and some), `kvring.store_tails` (default true: a prompt's whole
blocks past its last whole chunk are stored and loaded too, where loads are
asynchronous) and `kvring.runtime_dir`.

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

With vLLM's KV events on (`--kv-events-config`), the chunks kvring holds
for the engine's prompts are published with vLLM's own events, as blocks of
medium "CPU" under vLLM's block hashes: `get_kv_connector_kv_cache_events`
(worker) reports which chunks its stores left in the pool, and
`take_events` (scheduler) hands vLLM the `BlockStored` and the lazily
learned `BlockRemoved` events (`kvring.vllm.events`, docs/vllm.md).

vLLM's scheduler and workers are separate (spawned) processes that import
this package by name; each has its own kvring client.

The package: `settings` (the keys above), `identity` (model id, ranks,
salts), `link` (the server connection, `kvring.link`),
`metadata` (what the scheduler sends its workers each step), `scheduler`
and `worker` (the two roles), `events` (what vLLM's KV events are told),
`stats`, `versions` (what the running vLLM offers), and here the facade
vLLM loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvring.vllm.identity import engine_model_id
from kvring.vllm.link import RECONNECT_INTERVAL_S
from kvring.vllm.log import logger
from kvring.vllm.metadata import KvringMetadata, LoadOp, StoreOp
from kvring.vllm.scheduler import SchedulerSide
from kvring.vllm.settings import KvringSettings
from kvring.vllm.stats import KvringStats
from kvring.vllm.versions import CacheHitSource, KVConnectorTransferResults
from kvring.vllm.worker import WorkerSide
from kvring.vllm_cache_groups import cache_groups

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "RECONNECT_INTERVAL_S",
    "KvringConnector",
    "KvringMetadata",
    "KvringSettings",
    "KvringStats",
    "LoadOp",
    "StoreOp",
    "engine_model_id",
]


def _ensure_recompute_policy(cfg: KVTransferConfig, say: bool) -> None:
    """A failed load must end in recompute, not in a failed request: vLLM
    0.32 defaults `kv_load_failure_policy` to "fail". The scheduler reads the
    policy right after constructing its connector, so setting it here, in
    the config this connector is handed, takes effect; every process sets
    it, so that each one's configuration reports the policy in force, and
    the scheduler's (`say`) says so once."""
    policy = getattr(cfg, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        if say:
            logger.info(
                "kvring: kv_load_failure_policy is 'recompute' (was %r): a failed kvring load is "
                "recomputed, never an error",
                policy,
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
            bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)),
            len(groups),
            eager_gpu=_eager_gpu(vllm_config),
        )
        model_id, identity = engine_model_id(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        _ensure_recompute_policy(self._kv_transfer_config, say=role == KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, settings, model_id, groups, getattr(kv_cache_config, "hash_block_size", None)
            )
            chunk = self._scheduler.chunk_tokens
        else:
            self._worker = WorkerSide(vllm_config, settings, model_id, groups)
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

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What kvring stored and lost of this engine's prompts, for vLLM's
        KV events (`kvring.vllm.events`): nothing unless they are on."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

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

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Which chunks this rank's stores left in the pool (vLLM carries
        them to the scheduler, which turns them into KV events)."""
        return self._worker.take_store_outcomes() if self._worker is not None else None

    # -- both roles

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvringStats(data=dict(data or {}))

    def shutdown(self) -> None:
        (self._scheduler or self._worker).shutdown()


def _eager_gpu(vllm_config: VllmConfig) -> bool:
    """Whether the engine runs on a GPU without CUDA graphs."""
    from vllm.platforms import current_platform

    model = getattr(vllm_config, "model_config", None)
    return bool(getattr(model, "enforce_eager", False)) and current_platform.is_cuda()
