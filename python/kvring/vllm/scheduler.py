"""The scheduler role: one lookup per request, the leases that hold its
hit, and each step's plan of loads and stores for the workers. It never
waits on the server: a lookup is submitted and polled, and a request whose
answer is not in waits in vLLM's queue."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kvring
from kvring import Client, KvringError, Lease, PendingLookup
from kvring.vllm.events import EventLedger, RequestBlocks, StoreOutcomes, kv_events_enabled
from kvring.vllm.identity import request_salt, world_size
from kvring.vllm.link import check_block_size, checked_chunk_tokens, server_link
from kvring.vllm.log import logger, warn_throttled
from kvring.vllm.metadata import KvringMetadata, LoadOp, StoreOp
from kvring.vllm.settings import KvringSettings
from kvring.vllm.stats import KvringStats
from kvring.vllm.versions import REPORTS_FAILED_LOADS
from kvring.vllm_cache_groups import (
    NULL_BLOCK,
    CacheGroup,
    load_span,
    state_candidates,
    state_to_store,
    storable_chunks,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class Phase(enum.Enum):
    """Where a request stands with the scheduler connector::

        NEW --submitted--> LOOKING_UP --answered or given up--> ANSWERED
         ^  ^                   |                                  |
         |  +--- the server's connection changed ------------------+
         |                                                     allocated
         |                                                         v
         +------------- preempted, asked again --------------- ADMITTED
                                                                   |
                                                   its load failed v
                                                              RECOMPUTED

    NEW: nothing asked of the server yet (none connected: a miss, and the
    request is admitted from here). LOOKING_UP: one lookup per attention
    KV cache group submitted, not all answered (`pending`); then, for a
    model with state groups, one per state group and candidate chunk
    (`state_pending`). ANSWERED: the hit is known (`hit_chunks`, held by
    `leases`). ADMITTED: vLLM allocated the
    request's blocks and its load, if any, is planned. RECOMPUTED: a load
    failed and vLLM recomputes the request; it is not looked up again (the
    same load would fail again).
    """

    NEW = enum.auto()
    LOOKING_UP = enum.auto()
    ANSWERED = enum.auto()
    ADMITTED = enum.auto()
    RECOMPUTED = enum.auto()


@dataclass
class _Tracked:
    """What the scheduler connector knows of one request."""

    hashes: list[bytes]
    salts: list[int]
    """The salt of its chunks' keys in each KV cache group."""
    phase: Phase = Phase.NEW
    # The lookups (one per KV cache group) submitted and not all answered
    # yet, their answers so far, and when they were submitted.
    pending: list[PendingLookup] | None = None
    answers: dict[int, Lease] = field(default_factory=dict)
    pending_since: float = 0.0
    # A model with state groups: the attention groups' leases, then the
    # chunks whose states could end the hit (the latest first), a lookup
    # per chunk and state group (chunk after chunk), and their answers.
    kv_leases: list[Lease] = field(default_factory=list)
    state_chunks: list[int] = field(default_factory=list)
    state_pending: list[PendingLookup] | None = None
    state_answers: dict[int, Lease] = field(default_factory=dict)
    max_chunks: int = 0
    """The most chunks a hit may have (`_max_hit_chunks`)."""
    # One lease per KV cache group while they hold hits.
    leases: list[Lease] = field(default_factory=list)
    lease_client: Client | None = None
    hit_chunks: int = 0
    local_tokens: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group: its block ids as vLLM announced them (positions a
    sliding-window group freed keep their old id: never stored from)."""
    stored_chunks: int = 0
    stores_stopped: bool = False
    """A sliding-window group freed a chunk's first blocks before it could
    be stored: nothing more of the request is stored, its tail neither."""
    stores_issued: bool = False
    load_blocks: frozenset[int] = frozenset()
    blocks: RequestBlocks | None = None
    """vLLM's block hashes and tokens of its chunks (vLLM's KV events on)."""
    tokens: list[int] = field(default_factory=list)
    """The prompt's token ids (the request's own list), described to a
    server that publishes KV events."""
    tail: bytes | None = None
    """The key of the prompt's whole blocks past its last whole chunk
    (`kvring.prompt_hashes`), where it has a tail (`SchedulerSide._tails`)."""
    tail_end: int = 0
    """Where the tail ends: the prompt's whole blocks."""
    tail_leases: list[Lease] = field(default_factory=list)
    """The tail's lookups' leases (one per attention group, as
    `SchedulerSide._kv_groups`) while every one holds the tail."""
    tail_done: bool = False
    """The tail was loaded, or its store issued."""


STATE_CANDIDATES = 4
"""How many chunk boundaries, the latest first, a lookup asks each state
group for (`kvring.vllm_cache_groups.state_candidates`)."""


def _poll_all(pending: list[PendingLookup], answers: dict[int, Lease]) -> bool:
    """Polls the lookups not answered yet (their answers into `answers`, by
    position); whether all are answered."""
    for i, p in enumerate(pending):
        if i not in answers:
            lease = p.poll()
            if lease is not None:
                answers[i] = lease
    return len(answers) == len(pending)


class SchedulerSide:
    """The scheduler role: lookups, leases, and each step's load and store plan."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: KvringSettings,
        model_id: int,
        groups: list[CacheGroup],
        hash_block_size: int | None = None,
    ) -> None:
        cfg = vllm_config.kv_transfer_config
        self._settings = settings
        self._model_id = model_id
        self._groups = groups
        self._kv_groups = [g for g in groups if not g.state]
        self._state_groups = [g for g in groups if g.state]
        self._world_size = world_size(vllm_config)
        self._loads_enabled = cfg.is_kv_consumer and bool(groups)
        self._stores_enabled = cfg.is_kv_producer and bool(groups)
        if len(groups) > 1 and not REPORTS_FAILED_LOADS:
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
            check_block_size(self._block_size, settings.chunk_tokens)
        self.chunk_tokens: int | None = None
        # What vLLM's KV events are told of kvring's contents (None: off).
        self._hash_block_size = hash_block_size or self._block_size
        self._ledger = (
            EventLedger(self._world_size, self._block_size) if kv_events_enabled(vllm_config) and groups else None
        )
        self._server_pid: int | None = None
        # The server publishes KV events: the chunks this engine stores are
        # described to it (their token ids) before their stores.
        self._describe = False
        self._link = server_link(settings, cfg.engine_id, self._on_connect)
        check_block_size(self._block_size, self.chunk_tokens)
        self._blocks_per_chunk = self.chunk_tokens // self._block_size
        self._tracked: dict[str, _Tracked] = {}
        self._fresh_blocks: set[str] = set()
        self._pending_loads: list[LoadOp] = []
        # Requests whose load is planned and not reported finished yet.
        self._loading: set[str] = set()
        self.stats = KvringStats()

    def _on_connect(self, client: Client) -> None:
        self.chunk_tokens = checked_chunk_tokens(client, self._settings, self.chunk_tokens)
        self._describe = bool(client.server_config().get("kv_events", False))
        pid = getattr(client, "server_pid", None)
        if self._ledger is not None and self._server_pid is not None and pid != self._server_pid:
            # Another server: nothing reported is in it (a second tier it
            # kept is found again by lookups, and reported then).
            logger.info(
                "kvring: the server %r restarted: the %d chunks reported to vLLM's KV events are "
                "reported removed",
                self._settings.name,
                self._ledger.reported,
            )
            self._ledger.forget_all()
        self._server_pid = pid

    # -- lookup

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt's hit beyond vLLM's local `num_computed_tokens`, loaded
        asynchronously; None while its lookup is not answered (vLLM asks
        again at a later step). One LOOKUP per admission: vLLM asks again
        while a request waits, and gets the same lease's answer. Whole chunks only,
        up to the whole prompt where vLLM allows it (`_max_hit_chunks`), then
        the prompt's tail where it is stored (`_tails`)."""
        t = self._tracked.get(request.request_id)
        if t is None:
            t = self._track(request)
            if t is None:
                return 0, False
        if (
            not self._loads_enabled
            or t.phase is Phase.RECOMPUTED
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            # After a failed load the request is recomputed: its old answer
            # must not be replayed (the load would fail again, forever).
            return 0, False
        if t.phase is Phase.ADMITTED:
            # Asked again after an allocation: preempted and re-admitted. The
            # retrieve consumed or freed the old holds; look up afresh. Its
            # old blocks are someone else's now.
            self._end_lease(t)
            self._loading.discard(request.request_id)
            t.load_blocks = frozenset()
            t.phase, t.hit_chunks = Phase.NEW, 0
        client = self._link.client()
        if (t.leases or t.pending is not None or t.state_pending is not None) and t.lease_client is not client:
            t.leases, t.lease_client, t.pending, t.answers = [], None, None, {}
            t.kv_leases, t.state_chunks, t.state_pending, t.state_answers = [], [], None, {}
            t.tail_leases = []
            t.phase, t.hit_chunks = Phase.NEW, 0
        if t.phase in (Phase.NEW, Phase.LOOKING_UP):
            if client is None:
                return 0, False
            if t.phase is Phase.NEW:
                t.max_chunks = self._max_hit_chunks(request)
                self._submit_lookup(client, t)
            if t.phase is Phase.LOOKING_UP and not self._poll_lookup(t):
                # Not answered yet: the request waits, the scheduler goes on.
                return None, False
        usable = min(t.hit_chunks, self._max_hit_chunks(request))
        t.local_tokens = num_computed_tokens
        hit = usable * self.chunk_tokens
        if t.tail_leases and usable == len(t.hashes):
            # Every whole chunk, then the tail's blocks.
            hit = t.tail_end
        external = hit - num_computed_tokens
        if external <= 0 or external < self._settings.min_load_tokens:
            return 0, False
        return external, self._settings.async_load

    def _tails(self) -> bool:
        """Whether prompts' tails are stored and loaded (`kvring.store_tails`):
        where a hit may end past the last whole chunk (`_max_hit_chunks`),
        and the whole blocks after it would otherwise be computed in the
        hit's first step."""
        return self._settings.store_tails and self._past_the_last_token()

    def _past_the_last_token(self) -> bool:
        """Whether a hit may cover the whole prompt: after an asynchronous
        load vLLM recomputes the last token of a whole-prompt hit itself.
        Its window then reaches one token further back than the hit's
        (tokens N - W to N - 1 of a hit of N tokens, for a window of W),
        and vLLM holds the block of token N - W (it frees the blocks wholly
        before token N - W + 1) unless N - W + 1 starts a block: never
        where W - 1 is not a multiple of the block size, as N is. A state
        group has no state at the token before the last: not there."""
        if not self._settings.async_load or self._state_groups:
            return False
        return all(g.window is None or g.window % self._block_size != 1 for g in self._kv_groups)

    def _max_hit_chunks(self, request: Request) -> int:
        """The most chunks a hit may have: a prompt of whole chunks loads
        them all where vLLM then computes its last token again
        (`_past_the_last_token`), and its first step is one token, not a
        chunk; else the last token is left to compute."""
        n = request.num_tokens
        if self._past_the_last_token():
            return n // self.chunk_tokens
        return (n - 1) // self.chunk_tokens

    def _track(self, request: Request) -> _Tracked | None:
        """State for a request kvring can serve: a token prompt (multimodal
        placeholders and embeddings do not key their KV) of one full chunk
        or more."""
        if request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return None
        tail = None
        if self._tails():
            hashes, tail = kvring.prompt_hashes(request.prompt_token_ids, self.chunk_tokens, self._block_size)
        else:
            hashes = kvring.chunk_hashes(request.prompt_token_ids, self.chunk_tokens)
        if not hashes:
            return None
        t = _Tracked(
            hashes=hashes, salts=[request_salt(request, g) for g in self._groups], tokens=request.prompt_token_ids
        )
        if self._ledger is not None and getattr(request, "block_hashes", None) is not None:
            t.blocks = RequestBlocks(request, self._block_size, self._hash_block_size, self.chunk_tokens)
        if tail is not None:
            t.tail = tail
            t.tail_end = len(request.prompt_token_ids) // self._block_size * self._block_size
        self._tracked[request.request_id] = t
        return t

    def _submit_lookup(self, client: Client, t: _Tracked) -> None:
        """Submits the request's LOOKUP (the server must take it within
        `submit_s`); a failure is a miss."""
        self.stats.count("lookups")
        pending: list[PendingLookup] = []
        try:
            for salt in (t.salts[g.index] for g in self._kv_groups):
                pending.append(
                    client.submit_lookup(
                        self._model_id,
                        self._world_size,
                        t.hashes,
                        salt=salt,
                        timeout=self._settings.submit_s,
                    )
                )
            if t.tail is not None:
                # The tail's in every attention group, after the chunks'
                # (the last answers).
                for salt in (t.salts[g.index] for g in self._kv_groups):
                    pending.append(
                        client.submit_lookup(
                            self._model_id,
                            self._world_size,
                            [t.tail],
                            salt=salt,
                            timeout=self._settings.submit_s,
                        )
                    )
        except KvringError as e:
            for p in pending:
                p.cancel()
            self._link.failed("lookup", e)
            t.phase = Phase.ANSWERED
            return
        t.pending, t.answers = pending, {}
        t.pending_since = time.monotonic()
        t.lease_client = client
        t.phase = Phase.LOOKING_UP

    def _poll_lookup(self, t: _Tracked) -> bool:
        """Whether the pending lookup has an answer now (a lease, or a miss:
        failed, or not answered within `lookup_wait_s`)."""
        assert t.phase is Phase.LOOKING_UP
        try:
            if t.pending is not None and _poll_all(t.pending, t.answers):
                leases = [t.answers[i] for i in range(len(t.pending))]
                t.pending, t.answers = None, {}
                if t.tail is not None:
                    # Dropped unless every group holds the tail (their ends
                    # are queued).
                    n = len(self._kv_groups)
                    tails, leases = leases[-n:], leases[:-n]
                    t.tail_leases = tails if all(lease.hits for lease in tails) else []
                if not self._state_groups:
                    self._answered(t, leases)
                    return True
                self._submit_state_lookups(t, leases)
                if t.phase is not Phase.LOOKING_UP:
                    return True
            if t.state_pending is not None and _poll_all(t.state_pending, t.state_answers):
                self._state_answered(t)
                return True
        except KvringError as e:
            self._forget_lookup(t)
            self._link.failed("lookup", e)
            return True
        if time.monotonic() - t.pending_since < self._settings.lookup_wait_s:
            return False
        # Given up: a miss (the leases of lookups answered later are
        # ended once they are).
        self._forget_lookup(t)
        self.stats.count("lookups_given_up")
        return True

    def _submit_state_lookups(self, t: _Tracked, kv_leases: list[Lease]) -> None:
        """A model with state groups, once its attention groups answered: a
        lookup of each state group for each chunk whose state could end the
        hit (`STATE_CANDIDATES`, the latest first)."""
        hit = min(lease.hits for lease in kv_leases)
        candidates = state_candidates(hit, t.max_chunks, STATE_CANDIDATES)
        client = t.lease_client
        if not candidates or client is None:
            self._answered(t, kv_leases, None)
            return
        pending: list[PendingLookup] = []
        try:
            for chunk in candidates:
                for g in self._state_groups:
                    pending.append(
                        client.submit_lookup(
                            self._model_id,
                            self._world_size,
                            [t.hashes[chunk]],
                            salt=t.salts[g.index],
                            timeout=self._settings.submit_s,
                        )
                    )
        except KvringError:
            for p in pending:
                p.cancel()
            t.kv_leases = kv_leases
            raise
        t.kv_leases, t.state_chunks, t.state_pending, t.state_answers = kv_leases, candidates, pending, {}

    def _state_answered(self, t: _Tracked) -> None:
        """The hit ends after the latest candidate chunk whose state every
        state group has."""
        n = len(self._state_groups)
        answers = [t.state_answers[i] for i in range(len(t.state_chunks) * n)]
        best = next(
            (
                (chunk, answers[k * n : (k + 1) * n])
                for k, chunk in enumerate(t.state_chunks)
                if all(lease.hits for lease in answers[k * n : (k + 1) * n])
            ),
            None,
        )
        kv_leases = t.kv_leases
        t.kv_leases, t.state_chunks, t.state_pending, t.state_answers = [], [], None, {}
        # The other answers' leases are dropped: their ends are queued.
        self._answered(t, kv_leases, best)

    def _forget_lookup(self, t: _Tracked) -> None:
        """A miss: the lookups not answered are cancelled; the leases of
        those answered are dropped (their ends queued)."""
        for i, p in enumerate(t.pending or ()):
            if i not in t.answers:
                p.cancel()
        for i, p in enumerate(t.state_pending or ()):
            if i not in t.state_answers:
                p.cancel()
        t.pending, t.answers, t.lease_client = None, {}, None
        t.kv_leases, t.state_chunks, t.state_pending, t.state_answers = [], [], None, {}
        t.phase = Phase.ANSWERED

    def _answered(self, t: _Tracked, kv_leases: list[Lease], state: tuple[int, list[Lease]] | None = None) -> None:
        """A hit is the chunks every attention group has; with state groups,
        up to the end of the latest chunk each of them has the state of
        (`state`: that chunk and the state groups' leases)."""
        if t.blocks is not None:
            # What the lookup found corrects what vLLM's KV events were told
            # (of the attention groups: a state group's objects are not
            # published as vLLM's KV events).
            for g, lease in zip(self._kv_groups, kv_leases, strict=True):
                self._ledger.looked_up(
                    t.salts[g.index], t.hashes, lease.hits, lambda i, g=g: t.blocks.chunk(i, g.index)
                )
        t.phase = Phase.ANSWERED
        t.hit_chunks = min(lease.hits for lease in kv_leases)
        # Chunks present for every rank need no store.
        t.stored_chunks = max(t.stored_chunks, t.hit_chunks)
        leases: dict[int, Lease] = {g.index: lease for g, lease in zip(self._kv_groups, kv_leases, strict=True)}
        if self._state_groups:
            if state is None:
                t.hit_chunks = 0
            else:
                t.hit_chunks = state[0] + 1
                leases.update((g.index, lease) for g, lease in zip(self._state_groups, state[1], strict=True))
        if t.hit_chunks:
            t.leases = [leases[g.index] for g in self._groups]
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
        if t.phase in (Phase.ADMITTED, Phase.RECOMPUTED):
            return  # The second call, once an asynchronous load is done.
        t.phase = Phase.ADMITTED
        if num_external_tokens <= 0:
            self._end_lease(t)
            return
        planned = time.monotonic()
        c = self.chunk_tokens
        start = t.local_tokens
        end = start + num_external_tokens
        client = self._link.client()
        # A hit past the last whole chunk ends with the prompt's tail: a load
        # of its own in each attention group, from the tail's leases (kept,
        # and ended with the others: an end posted now could reach the
        # server before the retrieve).
        tail_ops: list[LoadOp] = []
        if t.tail_leases and end % c and end == t.tail_end:
            t.tail_done = True
            whole, b = end // c * c, self._block_size
            for g, lease in zip(self._kv_groups, t.tail_leases, strict=True):
                # From the first block the group holds (a sliding window's);
                # none held: the load fails, as a chunk's does.
                span = load_span(t.block_ids[g.index], max(start, whole), end, b, c)
                lease_id = lease.id if t.lease_client is client else None
                if span is None:
                    lease_id, skip, ids = None, 0, t.block_ids[g.index][whole // b : end // b]
                else:
                    skip, ids = span[1], span[2][: end // b - whole // b]
                tail_ops.append(
                    LoadOp(
                        req_id=request.request_id,
                        lease_id=lease_id,
                        first_chunk=0,
                        skip_tokens=skip,
                        block_ids=ids,
                        sync=not self._settings.async_load,
                        planned=planned,
                    )
                )
            end = whole
        usable = end % c == 0 and len(t.leases) == len(self._groups) and t.lease_client is client
        ops: list[LoadOp] = []
        groups = list(zip(self._groups, t.leases if usable else [None] * len(self._groups), strict=True))
        if tail_ops and start >= end:
            # vLLM holds every whole chunk itself: the tail alone.
            for _, lease in groups:
                if lease is not None:
                    self._release_unloaded(client, lease, 0, 0)
            groups = []
        for g, lease in groups:
            if g.state:
                # The state after the hit's last chunk, into the block vLLM
                # gives the hit's last token: the chunk's last block, the
                # ones before it skipped (null blocks, or states vLLM holds).
                bpc = self._blocks_per_chunk
                ids = t.block_ids[g.index][end // self._block_size - bpc : end // self._block_size]
                if len(ids) < bpc or ids[-1] == NULL_BLOCK or end // c != t.hit_chunks:
                    lease = None
                    ids = (ids + [NULL_BLOCK] * bpc)[:bpc]
                ops.append(
                    LoadOp(
                        req_id=request.request_id,
                        lease_id=None if lease is None else lease.id,
                        first_chunk=0,
                        skip_tokens=(bpc - 1) * self._block_size,
                        block_ids=ids,
                        sync=not self._settings.async_load,
                        planned=planned,
                    )
                )
                continue
            # From the first block the group holds: a sliding-window group
            # holds only its window's blocks before the first token to compute.
            span = load_span(t.block_ids[g.index], start, end, self._block_size, c)
            if span is None and tail_ops and g.window is not None and t.tail_end - g.window + 1 >= end:
                # The window lies in the tail: nothing of the chunks to load.
                if lease is not None:
                    self._release_unloaded(client, lease, 0, 0)
                continue
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
                    planned=planned,
                )
            )
            if lease is not None:
                self._release_unloaded(client, lease, first, end // c)
        ops.extend(tail_ops)
        self.stats.count("lookup_hit_tokens", num_external_tokens)
        t.load_blocks = frozenset(b for op in ops for b in op.block_ids[op.skip_tokens // self._block_size :])
        # Until finished_recving (asynchronous), or (in the step's forward)
        # until the request ends: its blocks are its own till then, so an
        # invalid one can only come from this load.
        self._loading.add(request.request_id)
        self._pending_loads.extend(ops)

    def _release_unloaded(self, client: Client, lease: Lease, first: int, last: int) -> None:
        """Frees the lease's holds outside chunks first..last-1 now rather
        than at the request's end. Posted, never waited for: a stopped
        server must not hold the step. A ring without room leaves the holds
        to the lease's end."""
        try:
            if first > 0:
                client.release_lease_chunks(lease.id, 0, first, post=True)
            if lease.hits > last:
                client.release_lease_chunks(lease.id, last, lease.hits - last, post=True)
        except KvringError as e:
            self._link.failed("release_lease_chunks", e)

    def _end_lease(self, t: _Tracked) -> None:
        """END_SESSION: frees whatever the leases still hold. Posted, never
        waited for: a stopped server must not hold the step (its holds go
        when the server reads the ring, or with this client's connection)."""
        leases, t.leases = t.leases, []
        leases.extend(t.tail_leases)
        t.tail_leases = []
        if t.lease_client is self._link.current:
            for lease in leases:
                try:
                    lease.end(post=True)
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
                    self._plan_tail_store(meta, new.req_id, t, new.num_computed_tokens, scheduled[new.req_id])
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
                    t.stored_chunks, t.stores_stopped = len(t.hashes), True
                for ids, more in zip(t.block_ids, new_block_ids, strict=True):
                    ids.extend(more)
            if store:
                self._plan_store(meta, req_id, t, cached.num_computed_tokens[i], scheduled[req_id])
                self._plan_tail_store(meta, req_id, t, cached.num_computed_tokens[i], scheduled[req_id])
        self._fresh_blocks.clear()
        return meta

    def _plan_store(self, meta: KvringMetadata, req_id: str, t: _Tracked, before: int, scheduled: int) -> None:
        """Stores the chunks this step completes (it computes `scheduled`
        tokens after `before`), in every KV cache group; where a
        sliding-window group no longer holds a chunk's first blocks (a
        chunked prefill that moved past its window), the request stores
        nothing more (a hit needs its chunks in every group)."""
        bpc = self._blocks_per_chunk
        for g in self._state_groups:
            chunk = state_to_store(
                t.block_ids[g.index], before + scheduled, len(t.hashes), self._block_size, self.chunk_tokens
            )
            if chunk is not None:
                # vLLM frees the block (or caches it and lends it out) while
                # the request runs: the next forward waits for this store.
                meta.stores.append(
                    StoreOp(
                        req_id=req_id,
                        hashes=[t.hashes[chunk]],
                        block_ids=t.block_ids[g.index][chunk * bpc : (chunk + 1) * bpc],
                        salt=t.salts[g.index],
                        freed_early=True,
                    )
                )
                t.stores_issued = True
        first = t.stored_chunks
        complete = min((before + scheduled) // self.chunk_tokens, len(t.hashes))
        if complete <= first:
            return
        n = min(
            storable_chunks(g, first, complete, before, self._block_size, self.chunk_tokens) for g in self._kv_groups
        )
        if n > 0 and self._describe:
            self._describe_chunks(t, first, n)
        if n > 0:
            for g in self._kv_groups:
                if t.blocks is not None:
                    for i in range(first, first + n):
                        chunk = t.blocks.chunk(i, g.index)
                        if chunk is not None:
                            self._ledger.expect(t.salts[g.index], t.hashes[i], chunk)
                meta.stores.append(
                    StoreOp(
                        req_id=req_id,
                        hashes=t.hashes[first : first + n],
                        block_ids=t.block_ids[g.index][first * bpc : (first + n) * bpc],
                        salt=t.salts[g.index],
                        freed_early=g.window is not None,
                    )
                )
            t.stores_issued = True
        if n == complete - first:
            t.stored_chunks = complete
        else:
            t.stored_chunks, t.stores_stopped = len(t.hashes), True

    def _plan_tail_store(self, meta: KvringMetadata, req_id: str, t: _Tracked, before: int, scheduled: int) -> None:
        """Stores the prompt's tail in every attention group once the
        forward computed it (a step of `scheduled` tokens after `before`),
        after every whole chunk was stored or found (a tail without them is
        never hit); not where a sliding-window group no longer holds the
        tail's first block."""
        if (
            t.tail is None
            or t.tail_done
            or t.stores_stopped
            or before + scheduled < t.tail_end
            or t.stored_chunks < len(t.hashes)
        ):
            return
        t.tail_done = True
        b, whole = self._block_size, len(t.hashes) * self.chunk_tokens
        # The tail as one more chunk: a window group may have freed its first
        # blocks before this step.
        tail_chunk = len(t.hashes)
        if any(
            not storable_chunks(g, tail_chunk, tail_chunk + 1, before, b, self.chunk_tokens) for g in self._kv_groups
        ):
            return
        for g in self._kv_groups:
            ids = t.block_ids[g.index][whole // b : t.tail_end // b]
            if len(ids) != (t.tail_end - whole) // b:
                return  # blocks this connector never saw
        for g in self._kv_groups:
            meta.stores.append(
                StoreOp(
                    req_id=req_id,
                    hashes=[t.tail],
                    block_ids=t.block_ids[g.index][whole // b : t.tail_end // b],
                    salt=t.salts[g.index],
                    tail=True,
                    freed_early=g.window is not None,
                )
            )
        t.stores_issued = True

    def _describe_chunks(self, t: _Tracked, first: int, n: int) -> None:
        """Tells the server the token ids of chunks `first .. first + n`
        under each of the request's salts, ahead of their stores (one
        request per 64 KiB of token ids). A failure costs the server's
        events their token ids, never the store."""
        client = self._link.client()
        if client is None:
            return
        tokens = t.tokens[: (first + n) * self.chunk_tokens]
        try:
            for salt in dict.fromkeys(t.salts):
                client.describe(
                    tokens, model_id=self._model_id, chunk_tokens=self.chunk_tokens, salt=salt, first_chunk=first
                )
        except KvringError as e:
            self._link.failed("describe", e)

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
                    if t.phase is not Phase.RECOMPUTED:
                        warn_throttled("load", "kvring: a load failed (request %s); vLLM recomputes it", req_id)
                    t.phase = Phase.RECOMPUTED
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            t = self._tracked.get(req_id)
            if t is not None:
                t.load_blocks = frozenset()
        outcomes = getattr(connector_output, "kv_cache_events", None)
        if self._ledger is not None and isinstance(outcomes, StoreOutcomes):
            self._ledger.outcomes(outcomes.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What vLLM's KV events learn of kvring's contents since the last
        call (`kvring.vllm.events`)."""
        return self._ledger.take() if self._ledger is not None else ()

    def request_finished(self, request: Request) -> bool:
        """Ends the lease; True (keep the blocks) when stores were issued for
        the request since its last preemption: the workers report them in
        finished_sending once their jobs end. (The scheduler cannot see job
        completion, so any issued store counts as in flight.)"""
        t = self._tracked.pop(request.request_id, None)
        self._loading.discard(request.request_id)
        if t is None:
            return False
        if t.pending is not None or t.state_pending is not None:
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
        if self._ledger is not None:
            self._ledger.forget_all()
        return True

    def shutdown(self) -> None:
        """Closing the connection ends every lease still held."""
        self._tracked.clear()
        self._link.close()
