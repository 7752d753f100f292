"""Type stubs of kvring's native module (the Rust client library and the
`kvring` / `kvring-inspect` commands). Import from `kvring`, not from here."""

from typing import Optional, Sequence

__version__: str
DEFAULT_CHUNK_TOKENS: int
DEFAULT_JOB_TIMEOUT: float
LAYOUT_PRESETS: list[str]

class KvringError(Exception):
    """Base of every kvring error."""

class ServerGone(KvringError):
    """The server exited or closed the connection."""

class NoServer(KvringError):
    """No server of that name is running (nothing to connect to)."""

class ServerTimeout(KvringError, TimeoutError):
    """A wait or call reached its deadline."""

class InvalidArgument(KvringError, ValueError):
    """Refused by the library before anything was sent."""

class RegistrationRefused(KvringError):
    """The server refused to register a KV cache; `str(e)` says why."""

class StatusError(KvringError):
    """The server answered a request with an error status; `.status` is its
    stable name (for instance "foreign_lease", "no_lease", "no_space")."""
    status: str

class ClientClosed(KvringError):
    """A handle was used after its client closed."""

class CopiesInFlight(KvringError):
    """A given-up job still had a copy under way at the quiesce bound."""

class ProtocolError(KvringError):
    """The peer broke the protocol, or this library and the server differ."""

def model_id(name: str) -> int:
    """The 64-bit id of a model name (nonzero), the same in every process."""

def salt_id(salt: Optional[str]) -> int:
    """The 64-bit id of a tenant salt; None is 0."""

def chunk_hashes(tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """The chain hash (16 bytes) of each full chunk of `tokens`."""

def prompt_hashes(
    tokens: Sequence[int], chunk_tokens: int, block_tokens: int
) -> tuple[list[bytes], Optional[bytes]]:
    """In one pass over `tokens`: the chain hash (16 bytes) of each full
    chunk, and the key of the whole blocks of `block_tokens` past the last
    full chunk, stored as a chunk of fewer blocks (None where there is no
    such block, or no full chunk before it)."""

class Layout:
    """A KV cache's geometry and where each layer lives in its allocations:
    row (layer, block, head, token) of K starts at
    k_offset + block*block_stride + head*head_stride + token*token_stride
    bytes into allocation `alloc` of its layer (V's from v_offset)."""

    def __init__(
        self,
        *,
        layers: int,
        blocks: int,
        block_tokens: int,
        heads: int,
        k_width: int,
        v_width: int,
        elem_bytes: int,
        allocations: Sequence[int],
        placements: Sequence[tuple[int, int, int, int, int, int]],
        shared: bool = False,
    ) -> None:
        """`k_width` / `v_width` in elements (v_width 0: no V, MLA);
        `allocations`: each allocation's bytes; `placements`: per layer
        (alloc, k_offset, v_offset, block_stride, head_stride, token_stride)
        in bytes; `shared`: one object for every rank (MLA)."""

    @staticmethod
    def preset(
        name: str,
        *,
        layers: int,
        blocks: int,
        block_tokens: int,
        heads: int,
        head_dim: int,
        elem_bytes: int,
    ) -> "Layout":
        """A named layout (`LAYOUT_PRESETS`), allocations as the preset sizes them."""

    layers: int
    blocks: int
    block_tokens: int
    heads: int
    page_bytes: int
    allocations: list[int]
    def validate(self, chunk_tokens: int) -> None: ...
    def object_bytes(self, chunk_tokens: int) -> int: ...
    def blocks_per_chunk(self, chunk_tokens: int) -> int: ...

class JobStatus:
    """A job's state read from shared memory."""

    state: str  # "pending", "running", "done", "failed", "tombstoned", "expired", "unknown"
    value: int  # result value (done / tombstoned with a result), else 0
    aux: int
    reason: Optional[str]  # failure reason's stable name (failed / tombstoned with a failure)
    @property
    def finished(self) -> bool:
        """Terminal: it can no longer change state."""
    @property
    def ok(self) -> bool:
        """Done (or tombstoned) with a result."""

class Job:
    """A STORE or RETRIEVE (or another asynchronous job). Released when
    `release()` is called, when the `with` block ends, or when collected."""

    id: tuple[int, int]
    def status(self) -> JobStatus:
        """Its state, read from shared memory (no syscall, no GIL release)."""
    def poll(self) -> JobStatus:
        """Its state without blocking, holding it to its own deadline: a
        STORE or RETRIEVE past its timeout, or whose server is gone, is given
        up (bounded) and raises ServerTimeout or ServerGone; otherwise the
        state, "pending" and "running" included. What a connector calls
        once per step."""
    def wait(self, timeout: Optional[float] = None) -> JobStatus:
        """Waits until it finished (releases the GIL). Past `timeout`
        seconds raises ServerTimeout; a STORE or RETRIEVE past its own job
        timeout is given up first. ServerGone when the server dies."""
    def give_up(self, timeout: Optional[float] = None) -> None:
        """No copy of it starts afterwards; waits for one under way, at most
        `timeout` seconds (default the library's bound, 5 s), then raises
        CopiesInFlight if one still is."""
    @property
    def layer_groups(self) -> int:
        """The layer groups a RETRIEVE lands in (1 for any other job)."""
    def wait_layer_group(self, group: int, timeout: Optional[float] = None) -> None:
        """Waits (releases the GIL) until layer group `group` landed; a
        job that ends, passes its own timeout or loses its server first is
        waited for as `wait` does (raising as it does)."""
    def layer_group_landed(self, group: int) -> bool:
        """Whether layer group `group` landed (or the job was released)."""
    @property
    def released(self) -> bool:
        """Whether streams ordered after it may go on."""
    def release(self) -> None: ...
    def __enter__(self) -> "Job": ...
    def __exit__(self, *exc: object) -> None: ...

class Lease:
    """A LOOKUP's holds on the hit chunks (for every rank). Ended by `end()`,
    the `with` block, or when collected."""

    id: bytes  # 16 bytes: what a worker's retrieve names
    hits: int  # leading chunks found for every rank
    def end(self, *, post: bool = False) -> None:
        """END_SESSION: frees what it still holds. `post=True`: posted, never
        waited for (a stopped server costs nothing)."""
    def detach(self) -> bytes:
        """Keeps the holds past this handle (another process ends them with
        `Client.end_lease(id)`); returns the id."""
    def __enter__(self) -> "Lease": ...
    def __exit__(self, *exc: object) -> None: ...

class PendingLookup:
    """A LOOKUP submitted and not answered yet (`Client.submit_lookup`).
    Dropped or cancelled unanswered, its lease is ended once the lookup
    finishes."""

    def poll(self, timeout: float = 0.0) -> Optional[Lease]:
        """The lease once the server has answered (waiting `timeout`
        seconds at most), else None; raises the lookup's failure."""
    def cancel(self) -> None: ...

class Registration:
    """A registered KV cache. Unregistered by `Client.unregister`, the `with`
    block, or (queued) when collected."""

    id: int
    chunk_tokens: int
    blocks_per_chunk: int
    layout: Layout
    def __enter__(self) -> "Registration": ...
    def __exit__(self, *exc: object) -> None: ...

class Client:
    """A connection to the kvring server `name`. Its methods may be called
    from any thread; blocking calls release the GIL."""

    def __init__(
        self,
        name: str = "default",
        *,
        engine: Optional[str] = None,
        runtime_dir: Optional[str] = None,
        connect_timeout: float = 5.0,
        call_timeout: float = 10.0,
        wait: str = "default",
    ) -> None:
        """`engine`: the engine id (only its processes may use its leases);
        `wait`: how a blocked call waits: "default" (spin 20 us, yield
        200 us, then sleep on a futex), "spin" (busy until done: lowest
        latency, a core busy) or "park" (sleep at once)."""
    name: str
    @property
    def server_gone(self) -> bool: ...
    @property
    def server_pid(self) -> int: ...
    @property
    def server_heartbeat_age(self) -> float:
        """Seconds since the server last beat: it beats every 50 ms while it
        runs, so an age of several beats is a stopped or hung server."""
    def server_config(self) -> dict[str, int | str | bool]: ...
    def describe(
        self,
        tokens: Sequence[int],
        *,
        model_id: int,
        chunk_tokens: int,
        salt: int = 0,
        first_chunk: int = 0,
    ) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def clear(self) -> dict[str, int]: ...
    def ping(self, payload: bytes = b"", timeout: float = 5.0) -> bytes: ...
    def register_process_memory(
        self,
        layout: Layout,
        addresses: Sequence[int],
        *,
        model_id: int,
        world_size: int = 1,
        rank: int = 0,
        device: Optional[bytes] = None,
    ) -> Registration:
        """Registers a KV cache in this process's own memory (for instance a
        CPU torch tensor): allocation i of `layout` starts at address
        addresses[i]. The server copies with cross-memory attach; this
        process consents to it. Keep the memory alive until unregistered."""
    def register_cuda_ipc(
        self,
        layout: Layout,
        handles: Sequence[tuple[bytes, int]],
        *,
        model_id: int,
        world_size: int = 1,
        rank: int = 0,
        device: bytes,
    ) -> Registration:
        """Registers device memory: allocation i is `offset` bytes into the
        cuMemAlloc allocation whose 64-byte IPC handle is given."""
    def register_cuda_memory(
        self,
        layout: Layout,
        addresses: Sequence[int],
        *,
        model_id: int,
        world_size: int = 1,
        rank: int = 0,
    ) -> Registration:
        """Registers an engine's own device memory where it is: allocation i
        of `layout` starts at device address `addresses[i]` (a torch CUDA
        tensor's `data_ptr()`). The driver says which allocation holds each
        and how to share it: a cudaMalloc block (torch's caching allocator)
        by its IPC handle, VMM memory (torch's expandable segments, vLLM's
        extensible KV cache) as one POSIX fd per mapping; the device is the
        memory's (by UUID). Raises `InvalidArgument` with the reason for
        memory that cannot be shared (host memory, a cudaMallocAsync pool,
        VMM memory made without POSIX-fd handles, allocations on two
        devices)."""
    def unregister(self, reg: Registration) -> None: ...
    def lookup(
        self, model_id: int, world_size: int, hashes: Sequence[bytes], *, salt: int = 0
    ) -> Lease: ...
    def submit_lookup(
        self,
        model_id: int,
        world_size: int,
        hashes: Sequence[bytes],
        *,
        salt: int = 0,
        timeout: float = 1.0,
    ) -> PendingLookup:
        """LOOKUP without waiting for its answer: the server must take it
        within `timeout` seconds (else ServerTimeout)."""
    def release_lease_chunks(
        self, lease_id: bytes, first_chunk: int, n_chunks: int, *, post: bool = False
    ) -> None:
        """Frees a lease's holds on chunks that will not be retrieved.
        `post=True`: posted, never waited for (a full ring raises)."""
    def end_lease(self, lease_id: bytes) -> None: ...
    def store(
        self,
        reg: Registration,
        hashes: Sequence[bytes],
        blocks: Sequence[int],
        *,
        timeout: Optional[float] = None,
        salt: int = 0,
        after: Optional[bytes] = None,
        submit_timeout: Optional[float] = None,
    ) -> Job:
        """Copies `blocks` into the cache under `hashes`, as a job:
        `blocks_per_chunk` blocks a chunk, the last chunk 1 to
        `blocks_per_chunk` (a prompt's tail; the rest of its object is
        zeros). `submit_timeout`: how long the call waits for the server to take it
        (default: the call timeout; past it, ServerTimeout)."""
    def retrieve(
        self,
        reg: Registration,
        lease_id: bytes,
        blocks: Sequence[int],
        *,
        first_chunk: int = 0,
        skip_tokens: int = 0,
        timeout: Optional[float] = None,
        after: Optional[bytes] = None,
        layer_groups: int = 1,
        submit_timeout: Optional[float] = None,
    ) -> Job:
        """Copies chunks `first_chunk ..` of the lease into `blocks`
        (`blocks_per_chunk` a chunk, the last chunk 1 to `blocks_per_chunk`:
        its object's first rows). With
        `layer_groups` G > 1 the layers land in G groups, one after another
        (group k: layers k*L//G .. (k+1)*L//G of L): wait for a group with
        `Job.wait_layer_group` or `EngineStream.wait_layer_group` before
        reading its layers."""
    def delay_job(
        self, pending: float, running: float, *, value: int = 0, aux: int = 0
    ) -> Job:
        """A job that waits `pending` seconds, then runs `running` seconds
        and ends with (value, aux): the job path end to end, without KV."""
    def close(self) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: object) -> None: ...

class EngineStream:
    """An engine's CUDA stream (a torch stream) that waits on the device for
    STORE and RETRIEVE jobs. The client releases a waited-for job itself when
    it gives it up (its timeout, or the server gone), so the stream never
    waits on something only the server could release. Closing it (or the
    `with` block's end, or collection) gives up the jobs it waited for that
    are not released yet and drains the stream."""

    def __init__(self, device: int, stream: int) -> None:
        """Stream `stream` (torch: `torch.cuda.current_stream().cuda_stream`;
        0: the legacy default stream) of CUDA device `device`. It must
        outlive this object."""
    def wait_job(self, job: Job) -> None:
        """Later work on the stream waits until `job` is over."""
    def wait_layer_group(self, job: Job, group: int) -> None:
        """Later work on the stream waits until layer group `group` of
        `job` (and every group before it) landed; bounded as `wait_job`."""
    def synchronize(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "EngineStream": ...
    def __exit__(self, *exc: object) -> None: ...
