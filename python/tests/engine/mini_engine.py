"""A mini engine that drives the real `kvring.vllm.KvringConnector` the way
vLLM's V1 engine does, with every retrieved byte checked.

Processes and order follow vLLM 0.32/0.33 (`v1/core/sched/scheduler.py`,
`v1/worker/gpu/kv_connector.py`, `kv_connector_model_runner_mixin.py`):

- the scheduler process (vLLM's EngineCore) holds the SCHEDULER connector.
  Each step it schedules running requests first (preempting the last
  running one when blocks run out), then waiting ones: it asks
  `get_num_new_matched_tokens` (None: ask again next step), allocates
  blocks from a shuffled free list and calls `update_state_after_alloc`; a
  request with an asynchronous load waits (WAITING_FOR_REMOTE_KVS) until
  every rank reported it in `finished_recving`, and is then allocated the
  rest of its blocks with `update_state_after_alloc` called a second time.
  `build_connector_meta` goes, pickled inside the SchedulerOutput, to every
  worker; their outputs are aggregated as vLLM's KVOutputAggregator does (a
  request is finished sending / receiving once every rank reported it;
  invalid blocks are the union) and fed to `update_connector_output`. A
  finished request's blocks wait for `finished_sending` when
  `request_finished_all_groups` (what vLLM calls on a connector with
  `SupportsHMA`) returns True.
- each worker process (vLLM's GPU worker, one per tensor-parallel rank with
  heads / TP heads of its own) holds a WORKER connector and a KV cache
  allocated as a vLLM version allocates it (`kv_layouts`). Each step:
  `handle_preemptions`, `bind_connector_metadata`, the forward,
  `start_load_kv` (asynchronous loads start after the forward is
  launched), `wait_for_save`, `get_finished`,
  `get_block_ids_with_load_errors`, `get_kv_connector_stats`,
  `clear_connector_metadata`.

The forward writes, for every token it computes, KV bytes that are a
function of the token ids of the prefix up to that token, the layer, the
head, the byte and the rank (not the rank for MLA, whose KV every rank
shares), so equal prefixes give equal bytes, as a real model's do. When a
rank reports a load finished, it compares every byte of the loaded request's
blocks (on the device) with what the forward would have written there;
a difference fails the run, naming the layer, block, token, head and byte.

A scenario with a `window` is a model of two KV cache groups, as vLLM's
hybrid manager keeps one of full-attention and sliding-window layers: the
connector gets the `KVCacheConfig` of both groups, the scheduler a block
table per group, and the sliding-window group's blocks before the window of
the next token to compute are freed to the null block as vLLM's
`allocate_slots` frees them (so a store of its chunks must finish before
another request's forward writes those blocks), and a hit holds only the
window's blocks. Each model layer writes its group's blocks; layers 2j and
2j+1 view one tensor.

What the harness emulates rather than runs: vLLM's local prefix cache hit
(`RequestSpec.local_hit`: the tokens vLLM would find in its own blocks are
written into the request's first blocks by the workers in the step they
are allocated) and the model (the bytes above, and a sampled token that is a
function of the prefix).

The vLLM objects the connector reads (configs, Request, KVCacheBlocks,
SchedulerOutput, NewRequestData, CachedRequestData, KVConnectorOutput) are
the simple classes below, with vLLM 0.33's field names. Processes are
spawned (`multiprocessing.get_context("spawn")`); every wait on a pipe has
a deadline, and the test process kills the processes at the end or on any
failure.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import multiprocessing
import os
import random
import time
import traceback
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import kvring
import standin_vllm
from kv_layouts import (
    ALLOC_ENV,
    LAYER_NAME,
    KvCache,
    KvSpec,
    LayoutCase,
    allocate_kv_cache,
    in_expandable_segment,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the engine runs: CUDA when torch sees a device."""
BLOCK_TOKENS = 16
CHUNK_TOKENS = 64
NULL_BLOCK = 0
"""vLLM's null block: a group's positions it does not hold."""
START_TIMEOUT_S = 240.0
"""Starting the processes: importing vLLM takes ~10 s per process on 2 cores."""
STEP_TIMEOUT_S = 60.0
IDLE_EXIT_S = 3600.0
"""A child process waiting this long for a command exits."""


class EngineError(RuntimeError):
    """The engine failed: a process raised (its traceback is the message),
    a byte differed, or a deadline passed."""


# ---------------------------------------------------------------- vLLM objects


@dataclass
class ModelConfig:
    model: str
    dtype: torch.dtype
    total_num_kv_heads: int
    head_size: int
    use_mla: bool = False
    revision: str | None = None
    quantization: str | None = None

    def get_head_size(self) -> int:
        return self.head_size

    def get_num_kv_heads(self, parallel_config: ParallelConfig) -> int:
        if self.use_mla:
            return 1
        return max(1, self.total_num_kv_heads // parallel_config.tensor_parallel_size)


@dataclass
class CacheConfig:
    block_size: int
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1


@dataclass
class KVTransferConfig:
    engine_id: str
    kv_connector_extra_config: dict[str, Any]
    kv_connector: str = "KvringConnector"
    kv_connector_module_path: str = "kvring.vllm"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "fail"  # vLLM 0.32's default

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class SchedulerConfig:
    async_scheduling: bool = False


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()


class Request:
    """vLLM's Request, as far as the connector and this scheduler read it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.cache_salt: str | None = None
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.skip_reading_prefix_cache = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class KVCacheBlocks:
    """Block ids, one list per KV cache group."""

    block_ids: list[list[int]]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and not any(self.block_ids):
            return None
        return tuple(list(ids) for ids in self.block_ids)


@dataclass
class FullAttentionSpec:
    """vLLM's spec of a full-attention group (the connector reads the kinds
    of groups by their class names)."""

    block_size: int


@dataclass
class SlidingWindowSpec:
    block_size: int
    sliding_window: int


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    """vLLM's `KVCacheConfig`, as far as the connector reads it."""

    kv_cache_groups: list[KVCacheGroupSpec]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list[Any] = field(default_factory=list)
    sampling_params: Any = None
    pooling_params: Any = None
    lora_request: Any = None


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


# ---------------------------------------------------------------- the "model"

_M31 = 0x7FFFFFFF


def prefix_seeds(tokens: list[int]) -> list[int]:
    """Per position, a 31-bit hash of the token ids up to it."""
    seeds, h = [], 0x2545F491
    for t in tokens:
        h = (h * 1000003 + t + 1) % _M31
        seeds.append(h)
    return seeds


def sample(seed: int) -> int:
    """The token the model "samples" after a prefix of this seed."""
    return 3 + seed % 50000


def kv_bytes(seeds: torch.Tensor, layer: int, heads: torch.Tensor, row_bytes: int, rank_term: int) -> torch.Tensor:
    """The KV bytes `[T, H, row_bytes]` (int8) of tokens with prefix
    `seeds` [T], for `heads` (global head indices) of `layer`, computed on
    `seeds`' device."""
    base = (seeds * 0x9E37 + layer * 0x85EB + rank_term * 0xC2B2) & _M31
    idx = torch.arange(row_bytes, device=seeds.device, dtype=torch.int64)
    x = base[:, None, None] ^ ((heads * 0x27D4EB) & _M31)[None, :, None] ^ ((idx * 0x165667) & _M31)[None, None, :]
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M31
    x = ((x ^ (x >> 13)) * 0x297A2D39) & _M31
    x = x ^ (x >> 16)
    return (x & 0xFF).to(torch.uint8).view(torch.int8)


# ---------------------------------------------------------------- scenarios


@dataclass
class RequestSpec:
    """A request of a scenario. It arrives once every request in `after`
    is done (finished and its blocks freed). `local_hit`: tokens vLLM's own
    prefix cache would hold (a block multiple). `abort_after_ask`: aborted
    at the first step after it was asked for its hit and was not allocated."""

    name: str
    prompt: list[int]
    max_tokens: int = 3
    after: tuple[str, ...] = ()
    local_hit: int = 0
    abort_after_ask: bool = False


@dataclass
class Scenario:
    """One engine run: the requests, the server, and the KV cache."""

    name: str
    requests: list[RequestSpec]
    server_name: str
    runtime_dir: str
    device: str
    layout: LayoutCase
    layers: int
    heads: int
    head_size: int
    blocks: int
    kind: str = "caching"
    tp: int = 1
    usable_blocks: int | None = None
    max_num_batched_tokens: int = 128
    long_prefill_token_threshold: int = 0
    seed: int = 0
    max_steps: int = 5000
    corrupt_load: str | None = None
    corrupt_group: int = 0
    """The KV cache group whose loaded byte `corrupt_load` changes."""
    window: int | None = None
    """A sliding window (tokens): the model's layers alternate full attention
    (even) and this window (odd), which vLLM's hybrid manager keeps in two
    KV cache groups whose layers 2j and 2j+1 view one tensor; the window's
    group holds only the blocks its window reaches (the others are the null
    block)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """More `kvring.*` connector settings."""
    """A control of the check itself: the workers change one loaded byte of
    this request before checking its load, which must then fail."""
    engine_id: str = field(default_factory=lambda: f"mini-engine-{os.getpid()}-{time.monotonic_ns()}")
    """vLLM's `kv_transfer_config.engine_id`: one per engine, the same in
    every process of it."""

    def vllm_config(self) -> VllmConfig:
        mla = self.layout.mla
        return VllmConfig(
            model_config=ModelConfig(
                model=f"mini-engine/{self.layout.name}",
                dtype=torch.bfloat16,
                total_num_kv_heads=1 if mla else self.heads,
                head_size=self.head_size,
                use_mla=mla,
            ),
            cache_config=CacheConfig(block_size=BLOCK_TOKENS, cache_dtype=self.layout.cache_dtype),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp),
            kv_transfer_config=KVTransferConfig(
                engine_id=self.engine_id,
                kv_connector_extra_config={
                    "kvring.name": self.server_name,
                    "kvring.runtime_dir": self.runtime_dir,
                    "kvring.autostart": False,
                    # The harness checks loads as they are reported in
                    # finished_recving: the asynchronous path.
                    "kvring.async_load": True,
                    **self.settings,
                },
            ),
        )

    @property
    def groups(self) -> int:
        return 1 if self.window is None else 2

    def group_of(self, layer: int) -> tuple[int, int]:
        """(KV cache group, tensor) of model layer `layer`."""
        return (0, layer) if self.window is None else (layer % 2, layer // 2)

    def kv_cache_config(self) -> KVCacheConfig | None:
        """None for a model of one group (the connector then names every
        layer the engine registers), else the two groups."""
        if self.window is None:
            return None
        names = [LAYER_NAME.format(i) for i in range(self.layers)]
        return KVCacheConfig(
            kv_cache_groups=[
                KVCacheGroupSpec(names[0::2], FullAttentionSpec(BLOCK_TOKENS)),
                KVCacheGroupSpec(names[1::2], SlidingWindowSpec(BLOCK_TOKENS, self.window)),
            ]
        )

    def kv_spec(self) -> KvSpec:
        mla = self.layout.mla
        return KvSpec(
            layers=self.layers // self.groups,
            blocks=self.blocks,
            block_tokens=BLOCK_TOKENS,
            heads=1 if mla else self.heads // self.tp,
            head_size=self.head_size,
            head_size_v=0 if mla else self.head_size,
            dtype=self.layout.dtype,
        )


@dataclass
class RequestTrace:
    """What happened to one request."""

    asks: list[tuple[int, int | None, bool, int]] = field(default_factory=list)
    """get_num_new_matched_tokens: (num_local_computed, answer, async, preemptions so far)."""
    allocs: list[int] = field(default_factory=list)
    """num_external_tokens of each update_state_after_alloc call."""
    load_blocks: list[list[int]] = field(default_factory=list)
    """The blocks each asynchronous load went to (the whole request's so far)."""
    loaded_tokens: int = 0
    load_failures: int = 0
    verified: Counter = field(default_factory=Counter)
    """Bytes checked per rank after its loads finished."""
    preemptions: int = 0
    finished: bool = False
    aborted: bool = False
    delayed_free: bool = False
    """request_finished_all_groups returned True (blocks kept until finished_sending)."""
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    """Its blocks when it finished."""


@dataclass
class Report:
    """The outcome of a scenario."""

    vllm: str
    steps: int
    requests: dict[str, RequestTrace]
    worker_stats: dict[str, int]
    scheduler_stats: dict[str, int]
    checked_bytes: int
    leaked_blocks: int
    kv_load_failure_policy: str
    preemption_reuse: dict[str, set[str]]
    """Per preempted request, the other requests later given its blocks."""
    lease_probes: dict[str, tuple[int, int]]
    """Per aborted request, the server's leases just before and after."""
    workers: list[dict[str, Any]]


# ---------------------------------------------------------------- processes


class EngineProcesses:
    """One scheduler process and `workers` worker processes (spawned, with
    `env` added to their environment), reused by scenarios one at a time.
    Any failure ends them all (`close()`)."""

    def __init__(self, device: str, workers: int = 2, env: dict[str, str] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conn, sched_end = ctx.Pipe()
        pairs = [ctx.Pipe() for _ in range(workers)]
        try:
            with _environ(env or {}):
                for rank, (_, w_end) in enumerate(pairs):
                    self._start(ctx, _worker_process, (w_end, rank, device), f"mini-engine-worker-{rank}")
                sched_args = (sched_end, [s for s, _ in pairs], device)
                self._start(ctx, _scheduler_process, sched_args, "mini-engine-scheduler")
            for s, w in pairs:
                s.close()
                w.close()
            sched_end.close()
            self.info = self._recv(START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, target: Any, args: tuple, name: str) -> None:
        p = ctx.Process(target=target, args=args, name=name, daemon=True)
        p.start()
        self._procs.append(p)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, scenario: Scenario, timeout_s: float) -> Report:
        """Runs `scenario`; on a failure or past `timeout_s`, ends the
        processes and raises EngineError."""
        try:
            self._conn.send(("run", scenario))
            return self._recv(timeout_s, scenario.name)
        except BaseException:
            self.close()
            raise

    def _recv(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise EngineError(f"{what}: no answer from the engine within {timeout_s:.0f} s")
        status, payload = self._conn.recv()
        if status != "ok":
            raise EngineError(f"{what}: {payload}")
        return payload

    def close(self) -> None:
        """Closes the pipe (an idle scheduler exits, and its workers after
        it), then kills whatever still runs."""
        self._conn.close()
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        self._procs.clear()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in os.environ while processes are started (spawned children
    inherit it before they import anything)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def alloc_env(kind: str) -> dict[str, str]:
    """The environment the processes of an allocation kind start with."""
    return ALLOC_ENV.get(kind, {})


class _Link:
    """A pipe to a worker, every wait bounded."""

    def __init__(self, conn: Any, rank: int) -> None:
        self.conn = conn
        self.rank = rank

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout_s: float = STEP_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise EngineError(f"worker {self.rank}: no answer within {timeout_s:.0f} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise EngineError(f"worker {self.rank}: {payload}")
        return payload


def _serve(conn: Any, handle: Any) -> None:
    """A child's command loop: ("cmd", arg) in, ("ok", result) or
    ("error", traceback) out; ends when the other end is closed (EOF) or
    after IDLE_EXIT_S without a command."""
    while conn.poll(IDLE_EXIT_S):
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", handle(cmd, arg)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _child_setup(device: str) -> str:
    """Installs the vLLM stand-in where vLLM is missing (or forced), imports
    the connector; returns what provides vLLM."""
    logging.basicConfig(level=logging.WARNING, format="%(processName)s %(name)s %(levelname)s %(message)s")
    standin = standin_vllm.install(device)
    import kvring.vllm  # noqa: F401

    if standin:
        return "stand-in"
    import vllm

    return f"vllm {vllm.__version__}"


def _worker_process(conn: Any, rank: int, device: str) -> None:
    _child_setup(device)
    worker = _Worker(rank)
    _serve(conn, worker.handle)


def _scheduler_process(conn: Any, worker_conns: list[Any], device: str) -> None:
    try:
        provider = _child_setup(device)
        links = [_Link(c, rank) for rank, c in enumerate(worker_conns)]
        for link in links:
            link.send("ping")
        infos = [link.recv(START_TIMEOUT_S) for link in links]
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"vllm": provider, "workers": infos}))

    def handle(cmd: str, scenario: Scenario) -> Report:
        if cmd != "run":
            raise ValueError(f"unknown command {cmd!r}")
        return _run_scenario(scenario, links, provider)

    _serve(conn, handle)


# ---------------------------------------------------------------- worker


@dataclass
class _ReqState:
    """A request as the worker's model runner knows it: its blocks per KV
    cache group."""

    tokens: list[int]
    blocks: list[list[int]]


@dataclass
class LoadCheck:
    """A load to verify once it finished: tokens [0, end) of `tokens` in
    `block_ids` (per KV cache group, whole blocks; a group's null blocks
    hold nothing and are not checked)."""

    tokens: list[int]
    block_ids: list[list[int]]
    end: int


@dataclass
class WorkerStep:
    """The scheduler's step for a worker: vLLM's SchedulerOutput, plus what
    the harness adds (the local prefix hits to materialise, the loads to
    verify)."""

    scheduler_output: SchedulerOutput
    local_fills: list[LoadCheck]
    load_checks: dict[str, LoadCheck]


@dataclass
class WorkerOutput:
    sampled: dict[str, int]
    kv: KVConnectorOutput
    verified: dict[str, int]
    """Bytes checked per request whose load this rank finished this step."""


class _Worker:
    """A worker process: one rank's KV cache, WORKER connector and model runner."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.connector: Any = None
        self.cache: KvCache | None = None

    def handle(self, cmd: str, arg: Any) -> Any:
        if cmd == "ping":
            return {"rank": self.rank, "pid": os.getpid()}
        if cmd == "start":
            return self.start(arg)
        if cmd == "step":
            return self.step(arg)
        if cmd == "stop":
            return self.stop()
        raise ValueError(f"unknown command {cmd!r}")

    def start(self, sc: Scenario) -> dict[str, Any]:
        from kvring.vllm import KvringConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        standin_vllm.set_parallel_rank(self.rank)
        if sc.device == "cuda":
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.spec = spec = sc.kv_spec()
        self.sc = sc
        self.mla = sc.layout.mla
        self.corrupt = sc.corrupt_load
        self.heads = torch.arange(spec.heads, device=self.device) + (0 if self.mla else self.rank * spec.heads)
        vllm_config = sc.vllm_config()
        export_fd = sc.kind == "cumem" and _exports_fd(KvringConnector, vllm_config.kv_transfer_config)
        self.cache = allocate_kv_cache(sc.layout, spec, self.device, sc.kind, export_fd=export_fd)
        gen = torch.Generator(device=self.device).manual_seed(1000 + self.rank)
        for buf in self.cache.buffers:  # garbage, so that no stale zero passes for a copy
            buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, device=self.device, generator=gen))
        self.connector = KvringConnector(vllm_config, KVConnectorRole.WORKER, sc.kv_cache_config())
        tensors = list(self.cache.tensors.values())
        # Every model layer, as vLLM hands them over: with two groups,
        # layers 2j and 2j+1 are one tensor.
        self.connector.register_kv_caches(
            {LAYER_NAME.format(layer): tensors[sc.group_of(layer)[1]] for layer in range(sc.layers)}
        )
        self.reqs: dict[str, _ReqState] = {}
        self.checks: dict[str, LoadCheck] = {}
        self.invalid: set[int] = set()
        info = {
            "rank": self.rank,
            "device": str(self.device),
            "allocations": len(self.cache.buffers),
            "cache_bytes": sum(b.untyped_storage().nbytes() for b in self.cache.buffers),
        }
        if self.device.type == "cuda":
            info["expandable"] = [in_expandable_segment(b) for b in self.cache.buffers]
            info["export_fd"] = export_fd
        return info

    def stop(self) -> None:
        self.connector.shutdown()
        self.connector = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.cache.release()
        self.cache = None

    def step(self, ws: WorkerStep) -> WorkerOutput:
        so, conn = ws.scheduler_output, self.connector
        for fill in ws.local_fills:
            self._write(fill.tokens, fill.block_ids, 0, fill.end)
        self.checks.update(ws.load_checks)
        meta = so.kv_connector_metadata
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        self._update_states(so)
        sampled = self._forward(so)
        conn.start_load_kv(None)
        conn.wait_for_save()
        sending, recving = conn.get_finished(so.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        conn.clear_connector_metadata()
        self.invalid |= invalid
        verified = {}
        for req_id in recving or ():
            check = self.checks.pop(req_id, None)
            if check is not None and self.invalid.isdisjoint(b for ids in check.block_ids for b in ids):
                if req_id == self.corrupt:
                    g = self.sc.corrupt_group
                    view, _ = self.cache.token_rows(self.sc.group_of(g)[1])[0]
                    view[check.block_ids[g][-1], BLOCK_TOKENS - 1, 0, 0] += 1
                verified[req_id] = self._verify(req_id, check)
        return WorkerOutput(
            sampled=sampled,
            kv=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, kv_connector_stats=stats, invalid_block_ids=invalid
            ),
            verified=verified,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        """vLLM's model runner `_update_states`: new requests bring their
        tokens and blocks; running ones append new blocks; resumed ones
        replace theirs."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _ReqState(list(new.prompt_token_ids), [list(ids) for ids in new.block_ids])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.reqs[req_id] = _ReqState(list(cached.all_token_ids[req_id]), [list(ids) for ids in new_blocks])
                continue
            st = self.reqs[req_id]
            if req_id in cached.all_token_ids:
                st.tokens = list(cached.all_token_ids[req_id])
            if new_blocks is not None:
                for have, ids in zip(st.blocks, new_blocks, strict=True):
                    have.extend(ids)

    def _forward(self, so: SchedulerOutput) -> dict[str, int]:
        """Writes the KV of every scheduled token; samples a token for each
        request whose known tokens are all computed."""
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            st, start = self.reqs[req_id], starts[req_id]
            self._write(st.tokens, st.blocks, start, start + n)
            if start + n == len(st.tokens):
                token = sample(prefix_seeds(st.tokens)[-1])
                st.tokens.append(token)
                sampled[req_id] = token
        return sampled

    def _positions(self, tokens: list[int], blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, ...]:
        if end > len(blocks) * BLOCK_TOKENS:
            raise EngineError(f"tokens up to {end} but only {len(blocks)} blocks")
        seeds = torch.tensor(prefix_seeds(tokens[:end])[start:end], dtype=torch.int64, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        block_ids = torch.tensor(blocks, dtype=torch.int64, device=self.device)[pos // BLOCK_TOKENS]
        return seeds, block_ids, pos % BLOCK_TOKENS

    def _expected(self, seeds: torch.Tensor, layer: int) -> torch.Tensor:
        return kv_bytes(seeds, layer, self.heads, self.spec.row_bytes, 0 if self.mla else self.rank)

    def _write(self, tokens: list[int], blocks: list[list[int]], start: int, end: int) -> None:
        """The forward's KV of tokens start..end-1: every model layer into
        its group's blocks of its tensor."""
        if end <= start:
            return
        at = [self._positions(tokens, ids, start, end) for ids in blocks]
        for layer in range(self.sc.layers):
            g, tensor = self.sc.group_of(layer)
            seeds, block_ids, slots = at[g]
            data = self._expected(seeds, layer)
            for view, off in self.cache.token_rows(tensor):
                view[block_ids, slots] = data[:, :, off : off + view.shape[-1]]

    def _verify(self, req_id: str, check: LoadCheck) -> int:
        """Compares the whole loaded range (each group's blocks that hold
        anything) with what the forward writes; returns the bytes checked,
        raises EngineError at the first difference."""
        at = []
        for ids in check.block_ids:
            seeds, block_ids, slots = self._positions(check.tokens, ids, 0, check.end)
            held = block_ids != NULL_BLOCK
            at.append((seeds[held], block_ids[held], slots[held], held.nonzero().flatten()))
        checked = 0
        for layer in range(self.sc.layers):
            g, tensor = self.sc.group_of(layer)
            seeds, block_ids, slots, tokens = at[g]
            data = self._expected(seeds, layer)
            for view, off in self.cache.token_rows(tensor):
                want = data[:, :, off : off + view.shape[-1]]
                got = view[block_ids, slots]
                if not torch.equal(got, want):
                    i, h, b = (int(x) for x in (got != want).nonzero()[0])
                    t = int(tokens[i])
                    raise EngineError(
                        f"rank {self.rank}: request {req_id}'s loaded KV differs at layer {layer} (group {g}), "
                        f"block {check.block_ids[g][t // BLOCK_TOKENS]} (token {t}, slot {t % BLOCK_TOKENS}), "
                        f"head {h} of the rank, byte {off + b} of the row: got {int(got[i, h, b])}, "
                        f"expected {int(want[i, h, b])}"
                    )
                checked += got.numel()
        return checked


def _exports_fd(connector_cls: Any, kv_transfer_config: KVTransferConfig) -> bool:
    """vLLM 0.34's `kv_cache_export_handle_types`: the KV cache is made
    exportable as POSIX fds when the connector declares EXPORTS_FD."""
    from vllm.config.kv_transfer import KVCacheAccess

    return KVCacheAccess.EXPORTS_FD in connector_cls.kv_cache_access(kv_transfer_config)


# ---------------------------------------------------------------- scheduler


def _run_scenario(sc: Scenario, all_links: list[_Link], provider: str) -> Report:
    """Starts the workers' connectors and caches, runs the scheduler to the
    end, shuts the connectors down."""
    from kvring.vllm import KvringConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    links = all_links[: sc.tp]
    if len(links) < sc.tp:
        raise EngineError(f"{sc.tp} ranks asked for, {len(all_links)} worker processes")
    for link in links:
        link.send("start", sc)
    workers = [link.recv() for link in links]
    vllm_config = sc.vllm_config()
    connector = KvringConnector(vllm_config, KVConnectorRole.SCHEDULER, sc.kv_cache_config())
    sched = _Scheduler(sc, connector, links)
    sched.run()
    connector.shutdown()
    for link in links:
        link.send("stop")
    for link in links:
        link.recv()
    return Report(
        vllm=provider,
        steps=sched.step_no,
        requests=sched.traces,
        worker_stats=dict(sched.worker_stats),
        scheduler_stats=dict(sched.scheduler_stats),
        checked_bytes=sum(sum(t.verified.values()) for t in sched.traces.values()),
        leaked_blocks=sched.usable - len(sched.free),
        kv_load_failure_policy=vllm_config.kv_transfer_config.kv_load_failure_policy,
        preemption_reuse=sched.preemption_reuse(),
        lease_probes=sched.lease_probes,
        workers=workers,
    )


class _Scheduler:
    """vLLM's V1 scheduler reduced to what the connector sees: FCFS,
    chunked prefill within a token budget, preemption of the last running
    request when blocks run out, asynchronous KV loads."""

    def __init__(self, sc: Scenario, connector: Any, links: list[_Link]) -> None:
        self.sc, self.connector, self.links = sc, connector, links
        rng = random.Random(sc.seed)
        ids = list(range(1, sc.blocks))  # block 0 is vLLM's null block
        rng.shuffle(ids)
        self.usable = sc.usable_blocks or len(ids)
        self.free = deque(ids[: self.usable])
        self.blocks: dict[str, list[list[int]]] = {}
        """Per request, its block ids per KV cache group."""
        self.pending = list(sc.requests)
        self.specs = {r.name: r for r in sc.requests}
        self.requests: dict[str, Request] = {}
        self.traces: dict[str, RequestTrace] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.done: set[str] = set()
        self.held: set[str] = set()
        self.recved: set[str] = set()
        self.loading_from: dict[str, int] = {}
        """Loading requests: the first token their load brings."""
        self.failed_loads: set[str] = set()
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.prev_scheduled: set[str] = set()
        self.pending_counts: dict[str, Counter] = {"sending": Counter(), "recving": Counter()}
        self.alloc_log: list[tuple[int, str, list[int]]] = []
        self.preempt_log: list[tuple[int, str, list[int]]] = []
        self.worker_stats: Counter = Counter()
        self.scheduler_stats: Counter = Counter()
        self.lease_probes: dict[str, tuple[int, int]] = {}
        self.step_no = 0
        self._probe = kvring.Client(sc.server_name, runtime_dir=sc.runtime_dir)

    # -- the loop

    def run(self) -> None:
        try:
            while self.pending or len(self.done) < len(self.requests):
                if self.step_no >= self.sc.max_steps:
                    raise EngineError(f"{self.sc.name}: not done after {self.step_no} steps: {self._state()}")
                self.step()
        finally:
            self._probe.close()

    def _state(self) -> str:
        return (
            f"waiting {[(r.request_id, r.status.name) for r in self.waiting]}, "
            f"running {[r.request_id for r in self.running]}, held {sorted(self.held)}, free {len(self.free)}, "
            f"blocks {[(rid, sum(b != NULL_BLOCK for ids in g for b in ids)) for rid, g in self.blocks.items()]}"
        )

    def step(self) -> None:
        self.step_no += 1
        self._arrivals()
        self._aborts()
        so, extra = self._schedule()
        so.kv_connector_metadata = self.connector.build_connector_meta(so)
        self._update_after_schedule(so)
        ws = WorkerStep(so, *extra)
        for link in self.links:
            link.send("step", ws)
        outs = [link.recv() for link in self.links]
        self._update_from_output(so, outs)
        if not so.num_scheduled_tokens:
            time.sleep(0.001)  # nothing computed: transfers are being waited for

    def _arrivals(self) -> None:
        for spec in list(self.pending):
            if all(a in self.done for a in spec.after):
                self.pending.remove(spec)
                req = Request(spec.name, spec.prompt, spec.max_tokens)
                self.requests[spec.name] = req
                self.traces[spec.name] = RequestTrace()
                self.blocks[spec.name] = [[] for _ in range(self.sc.groups)]
                self.waiting.append(req)

    def _aborts(self) -> None:
        """Aborts (vLLM's finish_requests) waiting requests marked
        `abort_after_ask` that were asked and never allocated."""
        for req in list(self.waiting):
            rid = req.request_id
            if self.specs[rid].abort_after_ask and self.traces[rid].asks and not any(self.blocks[rid]):
                before = self._probe.stats()["leases"]
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_ABORTED
                self.traces[rid].aborted = True
                delay, _ = self.connector.request_finished_all_groups(req, ([],))
                if delay:
                    raise EngineError(f"request_finished_all_groups kept the blocks of {rid}, which has none")
                self.lease_probes[rid] = (before, self._probe.stats()["leases"])
                self.finished_req_ids.add(rid)
                self.done.add(rid)

    # -- scheduling

    def _schedule(self) -> tuple[SchedulerOutput, tuple[list[LoadCheck], dict[str, LoadCheck]]]:
        budget = self.sc.max_num_batched_tokens
        threshold = self.sc.long_prefill_token_threshold
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        new_reqs: list[Request] = []
        resumed: list[Request] = []
        local_fills: list[LoadCheck] = []
        load_checks: dict[str, LoadCheck] = {}
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if threshold > 0:
                n = min(n, threshold)
            while True:
                got = self._allocate(req, req.num_computed_tokens + n)
                if got is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if got is None:
                break
            scheduled_running.append(req)
            new_blocks[req.request_id] = got
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1

        skipped: deque[Request] = deque()
        while not preempted and budget > 0 and self.waiting:
            req = self.waiting[0]
            rid, trace = req.request_id, self.traces[req.request_id]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if rid not in self.recved:
                    skipped.append(self.waiting.popleft())
                    continue
                self._promote_loaded(req)
            ext, load_async, local = 0, False, 0
            if req.num_computed_tokens == 0:
                local = self.specs[rid].local_hit if req.num_preemptions == 0 else 0
                ext, load_async = self.connector.get_num_new_matched_tokens(req, local)
                trace.asks.append((local, ext, load_async, req.num_preemptions))
                if ext is None:
                    skipped.append(self.waiting.popleft())
                    continue
                computed = local + ext
            else:
                computed = req.num_computed_tokens
            n = 0 if load_async else min(req.num_tokens - computed, budget)
            if threshold > 0:
                n = min(n, threshold)
            if self._allocate(req, computed + n, computed) is None:
                break
            self.connector.update_state_after_alloc(req, KVCacheBlocks(self.blocks[rid]), ext)
            trace.allocs.append(ext)
            tokens = req.all_token_ids
            if local:
                if self.sc.window is not None:
                    raise EngineError("a local prefix hit is emulated for models of one KV cache group only")
                local_fills.append(LoadCheck(tokens, self.blocks[rid], local))
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = computed
                self.loading_from[rid] = local
                end = -(-computed // BLOCK_TOKENS)
                load_checks[rid] = LoadCheck(tokens, [ids[:end] for ids in self.blocks[rid]], computed)
                trace.load_blocks.append(list(self.blocks[rid][0]))
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.running.append(req)
            (resumed if req.status == RequestStatus.PREEMPTED else new_reqs).append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = computed
            new_blocks[rid] = [list(ids) for ids in self.blocks[rid]]
            num_scheduled[rid] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        cached_reqs = scheduled_running + resumed
        so = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=list(r.prompt_token_ids),
                    block_ids=tuple(list(ids) for ids in self.blocks[r.request_id]),
                    num_computed_tokens=r.num_computed_tokens,
                )
                for r in new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in cached_reqs],
                resumed_req_ids={r.request_id for r in resumed},
                new_token_ids=[],
                all_token_ids={
                    r.request_id: r.all_token_ids for r in cached_reqs if r.request_id not in self.prev_scheduled
                },
                new_block_ids=[
                    KVCacheBlocks(new_blocks[r.request_id]).get_block_ids(allow_none=True) for r in cached_reqs
                ],
                num_computed_tokens=[r.num_computed_tokens for r in cached_reqs],
                num_output_tokens=[len(r.output_token_ids) for r in cached_reqs],
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )
        return so, (local_fills, load_checks)

    def _allocate(self, req: Request, tokens: int, computed: int | None = None) -> list[list[int]] | None:
        """Blocks so that `req` covers `tokens` in every group, `computed`
        of them (default: its computed tokens) done; the new ones per
        group, or None (nothing taken) when too few are free. As vLLM's
        `allocate_slots`: a sliding-window group first frees the blocks
        wholly before the window of the next token to compute
        (`remove_skipped_blocks`), and gets the null block for the
        positions of a hit before it."""
        computed = req.num_computed_tokens if computed is None else computed
        skipped = 0 if self.sc.window is None else max(0, computed - self.sc.window + 1) // BLOCK_TOKENS
        for g, have in enumerate(self.blocks[req.request_id]):
            if g == 1:
                for i in range(min(skipped, len(have))):
                    if have[i] != NULL_BLOCK:
                        self.free.append(have[i])
                        have[i] = NULL_BLOCK
        total = -(-tokens // BLOCK_TOKENS)

        def null(g: int, i: int) -> bool:
            return g == 1 and i < skipped

        groups = list(enumerate(self.blocks[req.request_id]))
        if sum(not null(g, i) for g, have in groups for i in range(len(have), total)) > len(self.free):
            return None
        got_all = []
        for g, have in groups:
            got = [NULL_BLOCK if null(g, i) else self.free.popleft() for i in range(len(have), total)]
            have.extend(got)
            got_all.append(got)
            self.alloc_log.append((self.step_no, req.request_id, [b for b in got if b != NULL_BLOCK]))
        return got_all

    def _free(self, rid: str) -> None:
        """vLLM frees a request's blocks tail first, to the queue's end."""
        for ids in self.blocks[rid]:
            self.free.extend(b for b in reversed(ids) if b != NULL_BLOCK)
        self.blocks[rid] = [[] for _ in range(self.sc.groups)]

    def _preempt(self, req: Request) -> None:
        rid = req.request_id
        self.preempt_log.append((self.step_no, rid, [b for ids in self.blocks[rid] for b in ids if b != NULL_BLOCK]))
        self._free(rid)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.traces[rid].preemptions += 1
        self.waiting.appendleft(req)
        self.preempted_req_ids.add(rid)

    def _promote_loaded(self, req: Request) -> None:
        """vLLM's `_update_waiting_for_remote_kv`: the load is over; a full
        hit still computes the last token."""
        rid = req.request_id
        self.recved.discard(rid)
        start = self.loading_from.pop(rid)
        if rid in self.failed_loads:
            self.failed_loads.discard(rid)
        else:
            self.traces[rid].loaded_tokens += req.num_computed_tokens - start
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING

    def _update_after_schedule(self, so: SchedulerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        self.prev_scheduled = set(so.num_scheduled_tokens)
        self.finished_req_ids = set()
        self.preempted_req_ids = set()

    # -- outputs

    def _update_from_output(self, so: SchedulerOutput, outs: list[WorkerOutput]) -> None:
        kv = self._aggregate([o.kv for o in outs])
        for rank, out in enumerate(outs):
            for rid, nbytes in out.verified.items():
                self.traces[rid].verified[rank] += nbytes
        if kv.invalid_block_ids or kv.failed_recving:
            self._handle_invalid_blocks(kv.invalid_block_ids, kv.failed_recving)
        for rid, token in outs[0].sampled.items():
            req = self.requests[rid]
            req.output_token_ids.append(token)
            if len(req.output_token_ids) >= req.max_tokens:
                self._finish(req)
        self.connector.update_connector_output(kv)
        if (stats := self.connector.get_kv_connector_stats()) is not None:
            self.scheduler_stats.update(stats.data)
        for rid in kv.finished_recving or ():
            if self.requests[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise EngineError(f"{rid} reported finished receiving while {self.requests[rid].status.name}")
            self.recved.add(rid)
        for rid in kv.finished_sending or ():
            if rid not in self.held:
                raise EngineError(f"{rid} reported finished sending, but its blocks are not held")
            self.held.discard(rid)
            self._free(rid)
            self.done.add(rid)

    def _aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        """vLLM's KVOutputAggregator: finished once every rank reported it."""
        world = len(self.links)
        agg = KVConnectorOutput(finished_sending=set(), finished_recving=set())
        for out in outputs:
            agg.invalid_block_ids |= out.invalid_block_ids or set()
            agg.failed_recving |= out.failed_recving or set()
            for key, finished in (("sending", out.finished_sending), ("recving", out.finished_recving)):
                counts = self.pending_counts[key]
                for rid in finished or ():
                    counts[rid] += 1
                    if counts[rid] == world:
                        del counts[rid]
                        getattr(agg, f"finished_{key}").add(rid)
            if out.kv_connector_stats is not None:
                self.worker_stats.update(out.kv_connector_stats.data)
                agg.kv_connector_stats = (
                    out.kv_connector_stats
                    if agg.kv_connector_stats is None
                    else agg.kv_connector_stats.aggregate(out.kv_connector_stats)
                )
        return agg

    def _handle_invalid_blocks(self, invalid: set[int], failed: set[str]) -> None:
        """vLLM's recompute policy: a loading request keeps the tokens
        before its first invalid block and computes the rest."""
        for rid in list(self.requests):
            req = self.requests[rid]
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            blocks = self.blocks[rid][0]
            bad = [i for i, b in enumerate(blocks) if b in invalid]
            if rid in failed or bad:
                valid = bad[0] * BLOCK_TOKENS if bad else self.loading_from[rid]
                req.num_computed_tokens = min(req.num_computed_tokens, valid)
                self.failed_loads.add(rid)
                self.traces[rid].load_failures += 1

    def _finish(self, req: Request) -> None:
        rid = req.request_id
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        trace = self.traces[rid]
        trace.finished = True
        trace.output_token_ids = list(req.output_token_ids)
        trace.block_ids = list(self.blocks[rid][0])
        delay, _ = self.connector.request_finished_all_groups(req, tuple(list(ids) for ids in self.blocks[rid]))
        trace.delayed_free = bool(delay)
        self.finished_req_ids.add(rid)
        if delay:
            self.held.add(rid)
        else:
            self._free(rid)
            self.done.add(rid)

    def preemption_reuse(self) -> dict[str, set[str]]:
        reuse: dict[str, set[str]] = {}
        for step, victim, blocks in self.preempt_log:
            taken = set(blocks)
            reuse.setdefault(victim, set()).update(
                rid for s, rid, got in self.alloc_log if s >= step and rid != victim and taken.intersection(got)
            )
        return reuse
