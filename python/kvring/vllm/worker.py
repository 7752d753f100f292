"""The worker role: the KV cache registered once with the server, and each
step's RETRIEVE and STORE jobs, polled from their status words in shared
memory. The forward waits only for loads of its own step, each bounded by
the load's deadline; stores never hold a step."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import kvring
from kvring import Client, Job, KvringError, Registration
from kvring.tensors import (
    KvCacheMemory,
    KvCacheUnsupported,
    KvGeometry,
    describe_kv_caches,
    describe_opaque_blocks,
    register_kv_cache_memory,
)
from kvring.vllm.events import StoreOutcome, StoreOutcomes, kv_events_enabled
from kvring.vllm.identity import world_size
from kvring.vllm.link import check_block_size, checked_chunk_tokens, server_link
from kvring.vllm.log import logger
from kvring.vllm.metadata import KvringMetadata, StoreOp
from kvring.vllm.settings import KvringSettings
from kvring.vllm.stats import KvringStats
from kvring.vllm_cache_groups import CacheGroup, aliasing_error, slot_layers

if TYPE_CHECKING:
    from vllm.config import VllmConfig


LOADS_SEEN = 1024
"""Loads `WorkerSide.loads_seen` keeps."""


@dataclass(frozen=True)
class LoadSeen:
    """One request's load: submitted, then seen over (`time.monotonic`);
    `ok` false for a failed one."""

    req_id: str
    planned: float
    """When the scheduler planned it (its step's lookup and allocation)."""
    received: float
    """When this worker got the step that carries it."""
    submitted: float
    seen_over: float
    polls: int
    """How many of this worker's steps looked at it before it was over."""
    chunks: int
    ok: bool


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
    submitted: float = field(default_factory=time.monotonic)
    """When it was submitted (`time.monotonic`, the clock of vLLM's request
    timestamps)."""
    planned: float = 0.0
    """A retrieve: when the scheduler planned it (`LoadOp.planned`)."""
    received: float = 0.0
    """A retrieve: when the worker got the step that carries it."""
    polls: int = 0
    """An asynchronous retrieve: the steps that looked at it."""
    status: Any = None
    """The job's final status, once read (a STORE's tells the chunks that
    got no space)."""
    keys: tuple[int, list[bytes]] | None = None
    """A STORE's salt and chunk hashes, kept while vLLM's KV events are on
    (`kvring.vllm.events`)."""

    def settle(self, ok: bool, stats: KvringStats, outcomes: list[StoreOutcome] | None = None, rank: int = 0) -> None:
        """Records the outcome once (the job released, the chunks counted;
        with `outcomes`, whether its chunks are all in the pool)."""
        if self.outcome is None:
            self.outcome = ok
            _release(self.job)
            self.event = None
            if ok:
                stats.count("store_chunks", self.chunks)
            else:
                stats.count("store_failures")
            if outcomes is not None and self.keys is not None:
                # A store that found no room for some chunks does not say
                # which: none of them is reported stored.
                stored = ok and getattr(self.status, "aux", 0) == 0
                salt, hashes = self.keys
                outcomes.extend(StoreOutcome(rank, salt, h, stored) for h in hashes)


class WorkerSide:
    """The worker role: the KV cache registration and the jobs of each step."""

    def __init__(
        self, vllm_config: VllmConfig, settings: KvringSettings, model_id: int, groups: list[CacheGroup]
    ) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self._settings = settings
        self._model_id = model_id
        self._cache_groups = groups
        self._world_size = world_size(vllm_config)
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
            check_block_size(self._block_size, settings.chunk_tokens)
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
        self._link = server_link(
            settings, vllm_config.kv_transfer_config.engine_id, self._on_connect, self._abandon_jobs
        )
        check_block_size(self._block_size, self.chunk_tokens)
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
        # What this rank's stores left in the pool, for vLLM's KV events
        # (None: they are off).
        self._outcomes: list[StoreOutcome] | None = [] if kv_events_enabled(vllm_config) else None
        self.stats = KvringStats()
        self.loads_seen: deque[LoadSeen] = deque(maxlen=LOADS_SEEN)
        """The latest loads as this worker saw them, for benchmarks to place
        next to vLLM's request timestamps."""

    def _on_connect(self, client: Client) -> None:
        self.chunk_tokens = checked_chunk_tokens(client, self._settings, self.chunk_tokens)
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
            views = {name: view for name, t in kv_caches.items() if (view := _view(t)) is not None}
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
        self._layer_group = {name: ((i + 1) * self._groups - 1) // layers for i, name in enumerate(kv_caches)}
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
        received = time.monotonic()
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
                    submit_timeout=self._settings.submit_s,
                )
            except KvringError as e:
                self._link.failed("retrieve", e)
                client = self._link.current
                self._load_failed(op.req_id, invalid, op.sync)
                continue
            # Whole chunks, a tail's last one short.
            chunks = -(-len(op.block_ids) * self._block_size // self.chunk_tokens)
            tr = _Transfer(job, time.monotonic() + timeout, chunks, invalid, event=event)
            tr.planned, tr.received = op.planned, received
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
        request, so the server wakes once per step) and one per prompt tail,
        ordered after the forward the engine queued (`engine_event`)."""
        client, reg = self._link.client(), self._registration
        event, after = self.engine_event() if client is not None and reg is not None else (None, None)
        # One STORE per salt, and one per prompt tail (a short chunk must be
        # its job's last).
        jobs: list[tuple[int, list[StoreOp]]] = []
        by_salt: dict[int, list[StoreOp]] = {}
        for op in ops:
            self._store_reqs.add(op.req_id)
            if op.tail:
                jobs.append((op.salt, [op]))
            else:
                by_salt.setdefault(op.salt, []).append(op)
        jobs[:0] = by_salt.items()
        if client is None or reg is None:
            for salt, group in jobs:
                self._not_stored(salt, [h for op in group for h in op.hashes])
            return
        for salt, group in jobs:
            hashes = [h for op in group for h in op.hashes]
            blocks = [b for op in group for b in op.block_ids]
            # The next forward waits for a store from blocks vLLM frees
            # early (`_wait_fence`): it gets a load's deadline, not a store's.
            freed_early = any(op.freed_early for op in group)
            timeout = self._settings.load_timeout_s if freed_early else self._settings.timeout_s
            if client is None:
                self._not_stored(salt, hashes)
                continue
            try:
                job = client.store(
                    reg, hashes, blocks, timeout=timeout, salt=salt, after=after, submit_timeout=self._settings.submit_s
                )
            except KvringError as e:
                self._link.failed("store", e)
                self.stats.count("store_failures")
                client = self._link.current
                self._not_stored(salt, hashes)
                continue
            shared = _Transfer(job, time.monotonic() + timeout, len(hashes), event=event)
            if self._outcomes is not None:
                shared.keys = (salt, hashes)
            for op in group:
                self._stores.setdefault(op.req_id, []).append(shared)
            if freed_early:
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
                    tr.status = tr.job.wait(timeout=max(0.0, tr.deadline - time.monotonic()))
                    ok = tr.status.ok
                except kvring.ServerTimeout:
                    _give_up(tr.job)
                    ok = False
                except KvringError:
                    ok = False
                self._settle_store(tr, ok)
        self._wait_fence()

    def _wait_fence(self) -> None:
        """Before this step's forward: the stores of sliding-window and
        state groups issued in earlier steps end first, since vLLM frees the
        blocks that leave a window, and the states a request has moved past,
        while the request runs and may give them to this step's tokens. On
        a GPU the engine's stream waits on the device, on a CPU this hook
        waits; either way no longer than the store's deadline,
        `kvring.load_timeout_s` (a store given up copies nothing more)."""
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
            self._seen(req_id, [tr], ok)
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
                    tr.polls += 1
                    tr.outcome = _outcome(tr, alive)
            if any(tr.outcome is None for tr in transfers):
                continue
            del self._loads[req_id]
            for tr in transfers:
                _release(tr.job)
            ok = all(tr.outcome for tr in transfers)
            self._seen(req_id, transfers, ok)
            if ok:
                self.stats.count("load_chunks", sum(tr.chunks for tr in transfers))
                self._recving.add(req_id)
            else:
                self._load_failed(req_id, [b for tr in transfers for b in tr.block_ids])

    def _seen(self, req_id: str, transfers: list[_Transfer], ok: bool) -> None:
        self.loads_seen.append(
            LoadSeen(
                req_id=req_id,
                planned=min(tr.planned for tr in transfers),
                received=min(tr.received for tr in transfers),
                submitted=min(tr.submitted for tr in transfers),
                seen_over=time.monotonic(),
                polls=max(tr.polls for tr in transfers),
                chunks=sum(tr.chunks for tr in transfers),
                ok=ok,
            )
        )

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
                    self._settle_store(tr, ok)
            if running:
                self._stores[req_id] = running
            else:
                del self._stores[req_id]

    def _settle_store(self, tr: _Transfer, ok: bool) -> None:
        tr.settle(ok, self.stats, self._outcomes, self._rank)

    def _not_stored(self, salt: int, hashes: list[bytes]) -> None:
        """A STORE that could not be submitted: its chunks are reported not
        stored by this rank (vLLM's KV events)."""
        if self._outcomes is not None:
            self._outcomes.extend(StoreOutcome(self._rank, salt, h, False) for h in hashes)

    def take_store_outcomes(self) -> StoreOutcomes | None:
        """What this rank's stores left in the pool since the last call, for
        the scheduler's KV events (None: nothing, or KV events off). Called
        by vLLM after `get_finished`, which polls the stores, in the same
        step."""
        if not self._outcomes:
            return None
        outcomes, self._outcomes = self._outcomes, []
        return StoreOutcomes(outcomes)

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
                    self._settle_store(tr, False)
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
        tr.status = st
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


def _view(t: Any) -> tuple | None:
    """What identifies a layer's view of the KV cache memory (address,
    shape, strides, dtype, element bytes): of its tensor, or of the first of
    its state tensors. None: neither."""
    if isinstance(t, (list, tuple)) and t:
        t = t[0]
    if not isinstance(t, torch.Tensor):
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.element_size())
