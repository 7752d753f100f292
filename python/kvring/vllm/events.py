"""What kvring holds of this engine's prompts, told through vLLM's own KV
events (`--kv-events-config`), so that the engine's event publisher carries
it to cache-aware routers beside the engine's own GPU blocks.

The events name vLLM's blocks as the engine's own events do (the block
hashes of `Request.block_hashes`, converted by vLLM's
`maybe_convert_block_hash`), with `medium="CPU"`:

- `BlockStored`, one per kvring chunk (its `chunk_tokens / block_size`
  blocks, the hash of the block before as parent, the chunk's token ids),
  once every rank's store of it ended with the chunk in the pool; or when a
  lookup finds a chunk this engine had not reported (stored by another
  engine on the node, or before a reconnect);
- `BlockRemoved`, learned lazily: when a lookup of a prompt finds fewer
  chunks than were reported for it, for the reported chunks past the hit;
  on `reset_cache` (the server cleared) and on a reconnect to a restarted
  server, for everything reported. Never `AllBlocksCleared`: on the
  engine's stream it would clear the engine's GPU blocks too.

The scheduler builds the events (it has the requests' block hashes and
tokens); the workers report only which chunks each of their stores left in
the pool (`StoreOutcomes`, carried by vLLM from every rank to the
scheduler), so nothing is added to the metadata the scheduler sends its
workers, and nothing at all is done while vLLM's KV events are off.

Pure bookkeeping: no server calls. Fields a vLLM version lacks are left out
(by the msgspec fields of its event classes), and without vLLM's KV event
classes nothing is reported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvring.vllm.log import logger

try:
    from vllm.distributed import kv_events as _kv_events
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents
except ImportError:  # no KV event classes in this vLLM: nothing is reported
    _kv_events = None
    BlockRemoved = BlockStored = None
    KVConnectorKVEvents = object

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _convert_hash
except ImportError:
    _convert_hash = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

MEDIUM = getattr(_kv_events, "MEDIUM_CPU", "CPU")
"""The medium of kvring's blocks in the events (vLLM's name for host memory)."""

REPORTED_CHUNKS = 100_000
"""The most chunks the scheduler remembers as reported (the oldest are told
removed past it: a router never keeps a chunk this engine cannot correct)."""

PENDING_CHUNKS = 100_000
"""The most chunks whose stores the scheduler waits to hear of from every
rank (the oldest are dropped, never reported, past it)."""


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with
    `enable_kv_cache_events`) and this vLLM has the classes to tell them."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False)) and BlockStored is not None


def external_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's own events carry it (an int of its last 8
    bytes unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    if _convert_hash is not None:
        return _convert_hash(block_hash)
    import os

    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return bytes(block_hash)
    return int.from_bytes(bytes(block_hash), "big") & ((1 << 64) - 1)


_dropped_fields: set[str] = set()


def _event(cls: Any, **fields: Any) -> Any:
    """`cls(**fields)` with only the fields this vLLM's class has (said
    once per field left out)."""
    known = set(getattr(cls, "__struct_fields__", ()))
    kept = {k: v for k, v in fields.items() if k in known}
    for k in fields.keys() - known:
        if k not in _dropped_fields and fields[k] is not None:
            _dropped_fields.add(k)
            logger.info("kvring: this vLLM's %s has no field %r; kvring's events go without it", cls.__name__, k)
    return cls(**kept)


# -- worker to scheduler


@dataclass(frozen=True)
class StoreOutcome:
    """One chunk of one rank's STORE: whether it ended with the chunk in the
    pool (`ok`)."""

    rank: int
    salt: int
    chunk_hash: bytes
    ok: bool


class StoreOutcomes(KVConnectorKVEvents):
    """What a worker's stores left in the pool since its last report, as
    vLLM carries a connector's KV events from every worker to the
    scheduler (it merges the workers' lists with `add_events` and
    `get_all_events`, and hands the merge to `update_connector_output`).
    Its entries are `StoreOutcome`s, not events: the scheduler turns them
    into events once every rank stored a chunk, whichever steps the ranks'
    stores end in (vLLM's own merge keeps what every rank reported in the
    same step)."""

    def __init__(self, outcomes: Iterable[StoreOutcome] = (), num_workers: int = 1) -> None:
        self._outcomes: list[StoreOutcome] = list(outcomes)
        self._workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self._outcomes.extend(events)

    def aggregate(self) -> StoreOutcomes:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._outcomes)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._outcomes.clear()
        self._workers = 1

    def __len__(self) -> int:
        return len(self._outcomes)

    def __repr__(self) -> str:
        return f"<StoreOutcomes {len(self._outcomes)} chunks, {self._workers} workers>"


# -- the scheduler's ledger


@dataclass
class ChunkBlocks:
    """A kvring chunk as vLLM's events name it: its blocks' hashes (vLLM's
    event form), the hash of the block before, its tokens, its group."""

    block_hashes: list[Any]
    parent: Any
    token_ids: list[int]
    group_idx: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class _Pending:
    chunk: ChunkBlocks
    ranks: set[int] = field(default_factory=set)


class RequestBlocks:
    """The vLLM block hashes and tokens of one request's prompt chunks."""

    def __init__(self, request: Request, block_size: int, hash_block_size: int, chunk_tokens: int) -> None:
        self._hashes = request.block_hashes  # vLLM appends as tokens come: read when needed
        self._tokens = request.prompt_token_ids
        self._block = block_size
        self._per_hash = max(1, block_size // hash_block_size)
        self._chunk = chunk_tokens
        lora = getattr(request, "lora_request", None)
        self._lora_id = None if lora is None else getattr(lora, "adapter_id", getattr(lora, "lora_int_id", None))
        self._lora_name = None if lora is None else getattr(lora, "name", getattr(lora, "lora_name", None))

    def _block_hash(self, j: int) -> Any:
        return external_hash(self._hashes[(j + 1) * self._per_hash - 1])

    def chunk(self, i: int, group_idx: int) -> ChunkBlocks | None:
        """Chunk `i` of the prompt in group `group_idx`; None when vLLM has
        not hashed all of its blocks."""
        bpc = self._chunk // self._block
        first, end = i * bpc, (i + 1) * bpc
        if len(self._hashes) < end * self._per_hash or len(self._tokens) < (i + 1) * self._chunk:
            return None
        return ChunkBlocks(
            block_hashes=[self._block_hash(j) for j in range(first, end)],
            parent=self._block_hash(first - 1) if first > 0 else None,
            token_ids=list(self._tokens[i * self._chunk : (i + 1) * self._chunk]),
            group_idx=group_idx,
            lora_id=self._lora_id,
            lora_name=self._lora_name,
        )


class EventLedger:
    """The scheduler's record of what it told vLLM's KV events of kvring's
    contents, and the events not taken yet.

    Chunks are keyed as kvring keys them for this engine: (salt, chunk
    hash), the salt naming the KV cache group (and cache salt, LoRA).
    `expect` notes a chunk whose store was planned; `outcomes` hears from
    the ranks and reports a chunk stored once every one of the
    `world_size` ranks stored it; `looked_up` corrects the record from a
    lookup's answer; `forget_all` reports everything removed."""

    def __init__(self, world_size: int, block_size: int) -> None:
        self._world = world_size
        self._block_size = block_size
        self._pending: OrderedDict[tuple[int, bytes], _Pending] = OrderedDict()
        # What a removal needs of a reported chunk: its block hashes, its group.
        self._reported: OrderedDict[tuple[int, bytes], tuple[list[Any], int]] = OrderedDict()
        self._events: list[Any] = []

    @property
    def reported(self) -> int:
        return len(self._reported)

    def expect(self, salt: int, chunk_hash: bytes, chunk: ChunkBlocks) -> None:
        key = (salt, chunk_hash)
        if key in self._reported or key in self._pending:
            return
        self._pending[key] = _Pending(chunk)
        while len(self._pending) > PENDING_CHUNKS:
            self._pending.popitem(last=False)

    def outcomes(self, outcomes: Iterable[StoreOutcome]) -> None:
        for o in outcomes:
            key = (o.salt, o.chunk_hash)
            p = self._pending.get(key)
            if p is None:
                continue
            if not o.ok:
                # One rank did not store it: a lookup would not hit it.
                del self._pending[key]
                continue
            p.ranks.add(o.rank)
            if len(p.ranks) >= self._world:
                del self._pending[key]
                self._stored(key, p.chunk)

    def looked_up(self, salt: int, chunk_hashes: Sequence[bytes], hits: int, chunk_of: Any) -> None:
        """A lookup of a prompt's chunks (`chunk_hashes`, under `salt`)
        found the first `hits` for every rank: chunks past them that were
        reported are reported removed; chunks within them not reported yet
        are reported stored (`chunk_of(i)` builds chunk `i`'s blocks)."""
        for i, h in enumerate(chunk_hashes):
            key = (salt, h)
            if i < hits:
                if key in self._reported:
                    self._reported.move_to_end(key)
                else:
                    chunk = chunk_of(i)
                    if chunk is not None:
                        self._pending.pop(key, None)
                        self._stored(key, chunk)
            else:
                blocks = self._reported.pop(key, None)
                if blocks is not None:
                    self._removed(*blocks)

    def forget_all(self) -> None:
        """The server lost everything (cleared, or a new server): every
        reported chunk is removed, and stores in flight are not reported."""
        self._pending.clear()
        reported, self._reported = self._reported, OrderedDict()
        for blocks in reported.values():
            self._removed(*blocks)

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def _stored(self, key: tuple[int, bytes], chunk: ChunkBlocks) -> None:
        self._reported[key] = (chunk.block_hashes, chunk.group_idx)
        self._events.append(
            _event(
                BlockStored,
                block_hashes=chunk.block_hashes,
                parent_block_hash=chunk.parent,
                token_ids=chunk.token_ids,
                block_size=self._block_size,
                lora_id=chunk.lora_id,
                medium=MEDIUM,
                lora_name=chunk.lora_name,
                group_idx=chunk.group_idx,
            )
        )
        while len(self._reported) > REPORTED_CHUNKS:
            _, old = self._reported.popitem(last=False)
            self._removed(*old)

    def _removed(self, block_hashes: list[Any], group_idx: int) -> None:
        self._events.append(_event(BlockRemoved, block_hashes=block_hashes, medium=MEDIUM, group_idx=group_idx))
