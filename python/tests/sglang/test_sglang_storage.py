"""kvring's SGLang storage backend against a real kvring server, driven as
SGLang 0.5.16's cache controller drives it: `register_mem_pool_host`, then
`batch_exists` / `batch_get_v1` from the prefetch threads and
`batch_set_v1` from the backup thread, on host pools laid out as SGLang
lays them out, every page read back where SGLang's own page metadata says
it lies."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time

import pytest
import torch
from host_pools import MHA_LAYOUTS, MLA_LAYOUTS, HostPool
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

import kvring
from kvring.sglang import KvringStorage

PAGE = 64
# SGLang's STORAGE_BATCH_SIZE: the pages of one call at most.
BATCH = 128


@pytest.fixture(autouse=True)
def watchdog():
    """Fails the run (rather than hanging CI) if one test runs past 120 s."""
    timer = threading.Timer(120, lambda: os.kill(os.getpid(), signal.SIGABRT))
    timer.start()
    yield
    timer.cancel()


def sglang_keys(n: int, seed: int = 0) -> list[str]:
    """Page keys as SGLang makes them: a SHA-256 chain over each page's
    token ids, in hex."""
    keys, prev = [], b""
    for i in range(n):
        tokens = b"".join(int(seed * 100_000 + i * PAGE + t).to_bytes(4, "little") for t in range(PAGE))
        prev = hashlib.sha256(prev + tokens).digest()
        keys.append(prev.hex())
    return keys


def config(server, *, model: str = "llama-test", tp: tuple[int, int] = (0, 1), mla: bool = False,
           **extra) -> HiCacheStorageConfig:
    extra_config = {
        "backend_name": "kvring",
        "module_path": "kvring.sglang",
        "class_name": "KvringStorage",
        "interface_v1": 1,
        "kvring.autostart": False,
    }
    if server is not None:
        extra_config.update({"kvring.name": server.name, "kvring.runtime_dir": server.dir})
    extra_config.update(extra)
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=extra_config,
    )


def backend(cfg: HiCacheStorageConfig, pool: HostPool) -> KvringStorage:
    """Created and registered as SGLang's StorageBackendFactory and cache
    controller do it."""
    b = KvringStorage(cfg, {})
    b.register_mem_pool_host(pool)
    return b


def exists(b: KvringStorage, keys: list[str]) -> int:
    """SGLang's `_storage_hit_query`: batches of 128, stopping at the first
    batch that is not a full hit."""
    hits = 0
    for i in range(0, len(keys), BATCH):
        n = b.batch_exists(keys[i : i + BATCH])
        hits += n
        if n < len(keys[i : i + BATCH]):
            break
    return hits


def stored_pages(pool: HostPool, pages: list[int], seed: int) -> None:
    for i, p in enumerate(pages):
        pool.fill_page(p, seed * 1000 + i)


@pytest.mark.parametrize(
    "mla,store_layout,load_layout",
    [(False, layout, "page_first") for layout in MHA_LAYOUTS]
    + [(False, "page_first", "layer_first"), (False, "page_first", "page_head")]
    + [(False, "page_head", "page_head")]
    + [(True, layout, "page_first") for layout in MLA_LAYOUTS]
    + [(True, "page_first", "page_first_direct")],
)
def test_pages_round_trip_between_engines_of_any_host_layout(server, mla, store_layout, load_layout):
    """One engine backs pages up; another, with a fresh poisoned host pool of
    the same or another layout, loads them into other slots: every byte
    where SGLang reads it, and nothing else touched."""
    src = HostPool(store_layout, mla=mla)
    keys = sglang_keys(7)
    src_pages = [3, 0, 5, 1, 8, 2, 11]
    stored_pages(src, src_pages, seed=1)
    a = backend(config(server, mla=mla), src)
    assert a.batch_set_v1(keys, src.slots(src_pages)) == [True] * 7
    assert exists(a, keys + sglang_keys(3, seed=9)) == 7

    dst = HostPool(load_layout, mla=mla)
    dst.poison()
    untouched = dst.page_bytes(4)
    b = backend(config(server, mla=mla), dst)
    assert exists(b, keys) == 7
    dst_pages = [9, 1, 6, 0, 10, 3, 2]
    assert b.batch_get_v1(keys, dst.slots(dst_pages)) == [True] * 7
    for s, d in zip(src_pages, dst_pages):
        assert torch.equal(dst.page_tensor(d).view(torch.uint8), src.page_tensor(s).view(torch.uint8)), f"{s}->{d}"
        if load_layout == store_layout:
            assert dst.page_bytes(d) == src.page_bytes(s), f"page {s} -> {d}"
    assert dst.page_bytes(4) == untouched
    a.close()
    b.close()


def test_a_load_ends_at_the_first_page_not_stored(server):
    pool = HostPool("page_first")
    keys = sglang_keys(6)
    stored_pages(pool, [0, 1, 2], seed=2)
    b = backend(config(server), pool)
    assert b.batch_set_v1(keys[:3], pool.slots([0, 1, 2])) == [True] * 3
    assert b.batch_exists(keys) == 3
    assert b.batch_get_v1(keys, pool.slots([4, 5, 6, 7, 8, 9])) == [True] * 3 + [False] * 3
    assert b.batch_exists(sglang_keys(2, seed=3) + keys) == 0
    b.close()


def test_keys_carry_the_model_the_rank_and_the_dtype(server):
    """SGLang's page keys hash token ids only; kvring's add what they lack,
    so two models, two dtypes or two ranks never share a page."""
    keys = sglang_keys(4)
    rank0, rank1 = HostPool("page_first"), HostPool("page_first")
    stored_pages(rank0, [0, 1, 2, 3], seed=4)
    stored_pages(rank1, [0, 1, 2, 3], seed=5)
    b0 = backend(config(server, tp=(0, 2)), rank0)
    b1 = backend(config(server, tp=(1, 2)), rank1)
    assert b0.batch_set_v1(keys, rank0.slots([0, 1, 2, 3])) == [True] * 4
    # A page is found only where every rank stored it.
    assert b0.batch_exists(keys) == 0 and b1.batch_exists(keys) == 0
    assert b1.batch_set_v1(keys, rank1.slots([0, 1, 2, 3])) == [True] * 4
    assert b0.batch_exists(keys) == 4 and b1.batch_exists(keys) == 4

    # Each rank loads its own pages.
    fresh = HostPool("page_first")
    fresh.poison()
    again1 = backend(config(server, tp=(1, 2)), fresh)
    assert again1.batch_get_v1(keys, fresh.slots([5, 6, 7, 8])) == [True] * 4
    assert [fresh.page_bytes(p) for p in (5, 6, 7, 8)] == [rank1.page_bytes(p) for p in (0, 1, 2, 3)]

    assert backend(config(server, model="another-model", tp=(0, 2)), HostPool("page_first")).batch_exists(keys) == 0
    assert backend(config(server, tp=(0, 1)), HostPool("page_first")).batch_exists(keys) == 0
    half = HostPool("page_first", dtype=torch.float16)
    assert backend(config(server, tp=(0, 2)), half).batch_exists(keys) == 0
    # A model with another shape: another model.
    assert backend(config(server, tp=(0, 2)), HostPool("page_first", heads=4)).batch_exists(keys) == 0


def test_a_full_batch_of_pages_moves_in_one_call(server):
    """128 pages, SGLang's largest call, as SGLang's backup and prefetch
    threads pass them (host slots out of order)."""
    pool = HostPool("page_first", pages=2 * BATCH + 1, layers=2, heads=1, head_dim=16)
    keys = sglang_keys(BATCH)
    src = list(range(BATCH))
    stored_pages(pool, src, seed=6)
    b = backend(config(server), pool)
    assert b.batch_set_v1(keys, pool.slots(src)) == [True] * BATCH
    assert exists(b, keys) == BATCH
    dst = list(range(2 * BATCH, BATCH, -1))
    assert b.batch_get_v1(keys, pool.slots(dst)) == [True] * BATCH
    assert all(pool.page_bytes(d) == pool.page_bytes(s) for s, d in zip(src, dst))
    b.close()


def test_what_kvring_cannot_serve_is_refused_saying_why(server):
    pool = HostPool("page_first")
    cfg = config(server)
    del cfg.extra_config["interface_v1"]
    with pytest.raises(kvring.KvringError, match='"interface_v1": 1'):
        KvringStorage(cfg, {})
    with pytest.raises(kvring.KvringError, match="unknown hicache_storage_backend_extra_config keys"):
        KvringStorage(config(server, **{"kvring.nmae": "x"}), {})
    with pytest.raises(kvring.KvringError, match="--page-size 64"):
        backend(config(server), HostPool("page_first", page_size=32, pages=8))
    with pytest.raises(kvring.KvringError, match="no kvring server named"):
        backend(config(None, **{"kvring.name": f"none-{os.getpid()}", "kvring.runtime_dir": server.dir}), pool)
    # Slots that are not whole pages of the pool: that call fails, not SGLang.
    b = backend(config(server), pool)
    assert b.batch_set_v1(sglang_keys(1), torch.arange(1, 1 + PAGE)) == [False]
    assert b.batch_set_v1(sglang_keys(1), pool.slots([0])) == [True]
    b.close()


def test_a_stopped_server_turns_into_misses_and_is_found_again(server):
    """SIGSTOP: every call misses within the submit bound (50 ms) and the
    stall bound (250 ms), nothing is written into the host pool, and once
    the server runs again the backend is back within about a second."""
    pool = HostPool("page_first")
    keys = sglang_keys(4)
    stored_pages(pool, [0, 1, 2, 3], seed=7)
    b = backend(config(server), pool)
    assert b.batch_set_v1(keys, pool.slots([0, 1, 2, 3])) == [True] * 4
    server.signal(signal.SIGSTOP)
    try:
        pool.poison_pages([6, 7, 8, 9])
        poisoned = [pool.page_bytes(p) for p in (6, 7, 8, 9)]
        t0 = time.monotonic()
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, pool.slots([6, 7, 8, 9])) == [False] * 4
        assert b.batch_set_v1(sglang_keys(2, seed=8), pool.slots([4, 5])) == [False] * 2
        elapsed = time.monotonic() - t0
        # The first call pays the bound once; the others miss at once.
        assert elapsed < 2.0, f"three calls on a stopped server took {elapsed:.3f} s"
        assert [pool.page_bytes(p) for p in (6, 7, 8, 9)] == poisoned
    finally:
        server.signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while b.batch_exists(keys) != 4:
        assert time.monotonic() < deadline, "the backend did not find the server again"
        time.sleep(0.05)
    b.close()


def test_a_killed_server_misses_at_once_and_a_restarted_one_is_used(server):
    pool = HostPool("page_first")
    keys = sglang_keys(3)
    stored_pages(pool, [0, 1, 2], seed=9)
    b = backend(config(server), pool)
    assert b.batch_set_v1(keys, pool.slots([0, 1, 2])) == [True] * 3
    server.keep_dir = True
    server.signal(signal.SIGKILL)
    server.proc.wait(10)
    t0 = time.monotonic()
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, pool.slots([3, 4, 5])) == [False] * 3
    assert time.monotonic() - t0 < 1.0
    from conftest import Server

    again = Server("--chunk-tokens", "64", "--pool-bytes", "64MiB", "--copy-threads", "1", restart_of=server)
    try:
        deadline = time.monotonic() + 5
        while b.batch_set_v1(keys, pool.slots([0, 1, 2])) != [True] * 3:
            assert time.monotonic() < deadline, "the backend did not reconnect to the restarted server"
            time.sleep(0.05)
        assert b.batch_exists(keys) == 3
        b.close()
    finally:
        again.stop()


def test_autostart_starts_a_server_whose_chunk_is_a_page(tmp_path):
    name = f"sglang-auto-{os.getpid()}"
    rundir = str(tmp_path / "run")
    pool = HostPool("page_first", page_size=32, pages=8)
    b = backend(config(None, **{"kvring.name": name, "kvring.runtime_dir": rundir, "kvring.autostart": True,
                                "kvring.pool_bytes": "16MiB"}), pool)
    with kvring.Client(name, runtime_dir=rundir) as c:
        pid = c.server_pid
        chunk = c.server_config()["chunk_tokens"]
    try:
        assert chunk == 32
        keys = sglang_keys(2)
        assert b.batch_set_v1(keys, pool.slots([0, 1])) == [True, True]
        assert b.batch_exists(keys) == 2
    finally:
        b.close()
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_load_given_up_on_a_stopped_server_writes_nothing_later():
    """A server SIGSTOPped while it copies a load into SGLang's host pool:
    the call returns within the stall bound, and once the server runs again
    not one byte lands in the pages SGLang now owns again."""
    from conftest import Server

    s = Server("--chunk-tokens", "64", "--pool-bytes", "320MiB", "--copy-threads", "1")
    try:
        # 2 MiB pages: a load of 64 takes tens of milliseconds to copy.
        pool = HostPool("page_first", layers=8, heads=8, head_dim=128, pages=130)
        keys = sglang_keys(64)
        src, dst = list(range(64)), list(range(64, 128))
        stored_pages(pool, src, seed=10)
        b = backend(config(s), pool)
        assert b.batch_set_v1(keys, pool.slots(src)) == [True] * 64
        given_up = 0
        for delay in (0.004, 0.002, 0.001, 0.0005, 0.0):
            pool.poison_pages(dst)
            stopper = threading.Timer(delay, lambda: s.signal(signal.SIGSTOP))
            stopper.start()
            t0 = time.monotonic()
            got = b.batch_get_v1(keys, pool.slots(dst))
            elapsed = time.monotonic() - t0
            stopper.join()
            assert elapsed < 2.0, f"a load on a stopped server took {elapsed:.3f} s"
            after = [pool.page_bytes(p) for p in dst]
            s.signal(signal.SIGCONT)
            time.sleep(0.3)
            assert [pool.page_bytes(p) for p in dst] == after, "bytes landed after the load was given up"
            if got == [True] * 64:
                assert after == [pool.page_bytes(p) for p in src]
            else:
                assert got == [False] * 64
                given_up += 1
            deadline = time.monotonic() + 5
            while b.batch_exists(keys) != 64:
                assert time.monotonic() < deadline, "the backend did not find the server again"
                time.sleep(0.05)
        assert given_up, "the server was never stopped before a load ended"
        b.close()
    finally:
        s.stop()
