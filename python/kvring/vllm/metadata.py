"""What the scheduler connector sends its workers each step (pickled into
vLLM's `SchedulerOutput`): loads and stores by chunk key and block id,
never token lists."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadOp:
    """Retrieve chunks `first_chunk ..` of a lease into `block_ids` (one per
    KV cache group of a request, and one for the prompt's tail, all in the
    same step; whole chunks, a tail's last one short; the first `skip_tokens` tokens are vLLM's local prefix hit, or
    before a sliding window, and stay untouched). `lease_id` None: the scheduler already knows the load
    cannot happen; the worker reports it failed at once."""

    req_id: str
    lease_id: bytes | None
    first_chunk: int
    skip_tokens: int
    block_ids: list[int]
    sync: bool = True
    """In this step's forward (True), or reported in finished_recving."""
    planned: float = 0.0
    """When the scheduler planned it (`time.monotonic`, the clock of vLLM's
    request timestamps): where a request's wait for its load goes."""


@dataclass
class StoreOp:
    """Store newly complete prompt chunks (`hashes`) from `block_ids`."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    salt: int
    freed_early: bool = False
    """From blocks vLLM frees while the request runs (a sliding-window
    group's, a state group's): the next step's forward waits for it
    (`handle_preemptions`)."""
    tail: bool = False
    """The prompt's tail (one chunk of fewer blocks, `kvring.prompt_hashes`): a
    STORE of its own, since a short chunk must be its job's last."""


@dataclass
class KvringMetadata(KVConnectorMetadata):
    """One step's work for every worker (pickled into vLLM's SchedulerOutput):
    chunk keys and block ids, never token lists."""

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: the worker finishes their stores before
    their blocks are reused, and neither side waits for them at finish."""
