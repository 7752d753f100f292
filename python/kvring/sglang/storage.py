"""`KvringStorage`: SGLang's HiCache storage backend on a kvring server.

SGLang creates it in each scheduler process (one per tensor-parallel rank)
and calls it from three threads: the prefetch thread (`batch_exists`), the
prefetch I/O thread (`batch_get_v1`) and the backup thread
(`batch_set_v1`); each call's return is its completion. Pages never pass
through Python: the host pool is registered once as this process's memory
and the server copies pages between it and its own pool
(`process_vm_readv` / `process_vm_writev`), a page a kvring object.

No call waits on a server that does not answer: the server must take each
request within `kvring.submit_s`, and a wait for its answer ends as soon as
the server has not beaten for `kvring.stall_s` (it beats every 50 ms). A
failed call drops the connection, so later calls miss at once until a new
connection (tried at most every second) reaches a server again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, TypeVar

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

import kvring
from kvring import Client, KvringError
from kvring.link import ServerLink
from kvring.log import warn_throttled
from kvring.sglang.host_pool import HostPoolView, describe_host_pool
from kvring.sglang.settings import StorageSettings

logger = logging.getLogger("sglang.kvring")

_SLICE_S = 0.01
"""How often a wait looks at the server's heartbeat."""

T = TypeVar("T")


class ServerStalled(kvring.ServerTimeout):
    """The server stopped beating while a call waited for it."""


def page_key(key: str) -> bytes:
    """kvring's 16-byte key of SGLang's page key (a hex SHA-256 chain over
    the prefix's token ids, or whatever string SGLang gives)."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class KvringStorage(HiCacheStorage):
    """SGLang's `dynamic` HiCache storage backend on kvring (module
    `kvring.sglang`, class `KvringStorage`, with `"interface_v1": 1`)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self._config = storage_config
        self._settings = StorageSettings.from_extra_config(storage_config.extra_config)
        # Guards the link (not thread-safe) and the set of jobs; reentrant:
        # a failed call drops the link, which abandons the jobs.
        self._lock = threading.RLock()
        self._link: ServerLink | None = None
        self._view: HostPoolView | None = None
        self._reg: kvring.Registration | None = None
        self._jobs: set[kvring.Job] = set()

    # -- set-up ---------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Connects (starting a server whose chunk is a page if none runs and
        `kvring.autostart`) and registers the host pool."""
        super().register_mem_pool_host(mem_pool_host)
        view = describe_host_pool(mem_pool_host, self._config, self._settings.model)
        view.layout.validate(view.page_size)
        self._view = view
        settings = replace(self._settings, chunk_tokens=view.page_size)
        self._link = ServerLink(
            settings,
            None,
            self._on_connect,
            self._abandon_jobs,
            logger=logger,
            config_hint="hicache_storage_backend_extra_config",
        )
        logger.info(
            "kvring: SGLang's host pool (%d pages of %d tokens) registered with the server %r as %s, rank %d of %d",
            view.pages,
            view.page_size,
            settings.name,
            view.model_text,
            view.rank,
            view.world_size,
        )

    def _on_connect(self, client: Client) -> None:
        view = self._view
        assert view is not None
        chunk = int(client.server_config()["chunk_tokens"])
        if chunk != view.page_size:
            raise KvringError(
                f"the kvring server {self._settings.name!r} stores {chunk}-token chunks and SGLang's "
                f"pages hold {view.page_size} tokens: run SGLang with --page-size {chunk}, or a kvring "
                f"server with --chunk-tokens {view.page_size}"
            )
        self._reg = client.register_process_memory(
            view.layout, [view.address], model_id=view.model_id, world_size=view.world_size, rank=view.rank
        )

    def _abandon_jobs(self) -> None:
        """Before a connection is dropped: no copy of its jobs starts later
        (a slow server must not write pages SGLang reuses)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), set()
        for job in jobs:
            _give_up(job, self._settings.stall_s)

    def close(self) -> None:
        self._abandon_jobs()
        with self._lock:
            link, self._link = self._link, None
        if link is not None:
            link.close()

    # -- the calls ------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (for every rank)."""
        if not keys:
            return 0
        return self._call("lookup", 0, lambda c, reg: self._lookup_hits(c, keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Loads the stored pages of `keys`, from the first, into the host
        slots `host_indices`; True for each page loaded."""
        n = len(keys)
        if n == 0:
            return []
        loaded = self._call("load", 0, lambda c, reg: self._load(c, reg, keys, host_indices))
        return [True] * loaded + [False] * (n - loaded)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Stores the pages in host slots `host_indices` under `keys`."""
        n = len(keys)
        if n == 0:
            return []
        stored = self._call("store", 0, lambda c, reg: self._store(c, reg, keys, host_indices))
        return [True] * stored + [False] * (n - stored)

    def clear(self) -> None:
        """Not done: the server is the node's cache, shared with every other
        engine; `kvring.Client.clear` (or a server restart) empties it."""
        logger.warning(
            "kvring: clear_hicache_storage does not empty kvring's pool, which every engine of the "
            "node shares; kvring.Client(%r).clear() empties it for all of them",
            self._settings.name,
        )

    # The generic (copying) interface: SGLang uses it only without
    # "interface_v1", which the constructor refuses.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_V1_ONLY)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_V1_ONLY)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError(_V1_ONLY)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError(_V1_ONLY)

    # -- inside ---------------------------------------------------------

    def _call(self, what: str, missed: T, body: Callable[[Client, kvring.Registration], T]) -> T:
        """`body` on the connected client and its registration of the host
        pool; `missed` without one or when it fails (a gone, stopped or
        stalled server drops the connection)."""
        with self._lock:
            link = self._link
            client = link.client() if link is not None else None
            reg = self._reg
        if client is None or reg is None:
            return missed
        try:
            return body(client, reg)
        except KvringError as e:
            with self._lock:
                if self._link is link and link is not None:
                    link.failed(what, e)
            return missed

    def _hashes(self, keys: list[str]) -> list[bytes]:
        return [page_key(k) for k in keys]

    def _lookup(self, c: Client, keys: list[str]) -> kvring.Lease | None:
        """The lease of a LOOKUP of `keys`, waited for while the server beats
        (None: no answer within `kvring.lookup_wait_s`, a miss)."""
        s, view = self._settings, self._view
        assert view is not None
        pending = c.submit_lookup(view.model_id, view.world_size, self._hashes(keys), timeout=s.submit_s)
        deadline = time.monotonic() + s.lookup_wait_s
        try:
            while (lease := pending.poll(_SLICE_S)) is None:
                if time.monotonic() >= deadline:
                    pending.cancel()
                    return None
                self._check_beating(c)
        except BaseException:
            pending.cancel()
            raise
        return lease

    def _lookup_hits(self, c: Client, keys: list[str]) -> int:
        lease = self._lookup(c, keys)
        if lease is None:
            return 0
        hits = lease.hits
        lease.end(post=True)
        return hits

    def _load(self, c: Client, reg: kvring.Registration, keys: list[str], host_indices: Any) -> int:
        view = self._view
        assert view is not None
        pages = view.page_of(host_indices)
        lease = self._lookup(c, keys)
        if lease is None:
            return 0
        try:
            hits = lease.hits
            if hits == 0:
                return 0
            job = c.retrieve(
                reg, lease.id, pages[:hits], timeout=self._settings.timeout_s, submit_timeout=self._settings.submit_s
            )
            self._await(c, job)
            return hits
        finally:
            lease.end(post=True)

    def _store(self, c: Client, reg: kvring.Registration, keys: list[str], host_indices: Any) -> int:
        view = self._view
        assert view is not None
        pages = view.page_of(host_indices)
        job = c.store(
            reg, self._hashes(keys), pages, timeout=self._settings.timeout_s, submit_timeout=self._settings.submit_s
        )
        status = self._await(c, job)
        # A full pool stores what fits, from the first chunk.
        return min(int(status.value), len(keys))

    def _await(self, c: Client, job: kvring.Job) -> kvring.JobStatus:
        """Waits for `job` while the server beats; a job that fails, or a
        server that stops, gives it up (no copy of it starts afterwards)."""
        with self._lock:
            self._jobs.add(job)
        # The job's own deadline, and a little for its give-up to settle.
        deadline = time.monotonic() + self._settings.timeout_s + 1.0
        try:
            while True:
                try:
                    status = job.wait(_SLICE_S)
                    break
                except kvring.ServerTimeout:
                    status = job.status()
                    if status.finished:
                        break
                    if time.monotonic() >= deadline:
                        raise
                    self._check_beating(c)
            if not status.ok:
                raise KvringError(f"the job failed: {status.reason}")
            return status
        except BaseException:
            _give_up(job, self._settings.stall_s)
            raise
        finally:
            with self._lock:
                self._jobs.discard(job)
            job.release()

    def _check_beating(self, c: Client) -> None:
        """Raises ServerStalled once the server has missed its beats for
        `kvring.stall_s` (the caller gives its request up)."""
        age = c.server_heartbeat_age
        if age > self._settings.stall_s:
            raise ServerStalled(f"the server has not beaten for {age * 1e3:.0f} ms")


def _give_up(job: kvring.Job, bound: float) -> None:
    """No copy of `job` starts afterwards, and none is under way unless the
    server stopped inside one (waited for `bound`: a running server ends a
    page's copy in milliseconds). Then a store only read SGLang's memory,
    and a load's write was made before the server stopped or is not made
    when it resumes (the server checks for a give-up right before it),
    but for a server stopped within the few instructions in between."""
    try:
        job.give_up(bound)
    except kvring.CopiesInFlight:
        warn_throttled(
            logger, "in-flight", "kvring: gave up a job whose copy a stopped server had under way; going on"
        )
    except KvringError:
        pass


_V1_ONLY = 'kvring serves SGLang through the zero-copy interface only ("interface_v1": 1)'
