"""What the Python API costs, side by side with the Rust client in one run.

* `status_poll_ns`: `Job.status()` of a running job from Python, each call
  timed alone (perf_counter_ns; its own cost, measured as `timer_ns`, is
  included) and as the mean of a batch;
* `lookup_us`: submit-to-done of a LOOKUP of a 128-chunk prompt whose
  chunks are stored (the lease ended after each), from Python;
  `submit_poll_us`: the same lookup as the vLLM connector's scheduler makes
  it (`submit_lookup` then one `poll()`, which a pool hit answers), timed
  in turn with the first in one loop;
* `store_gbps` / `retrieve_gbps`: a STORE (RETRIEVE) of 24 chunks of
  Llama-3-8B KV (32 layers, 8 KV heads of 128, bf16, 16-token blocks,
  256-token chunks, vLLM's default one-buffer layout) between random blocks
  of a cache in this process's memory (memory kind process_vm, as vLLM's CPU
  cache is registered) and the server's pool, submit to done, median pass;
  then `kvring-bench kv --memory process` (the Rust client, the same
  geometry, layout, memory kind and copy threads) in the same run, and the
  ratios Python / Rust.

    python bench/bench_python.py --rust-bench target/release/kvring-bench [--json]
    python bench/bench_python.py --backend cuda --rust-bench kvring-bench [--json]

`--backend cuda` (a GPU, torch): the store / retrieve jobs move 64 chunks
(2 GiB) between a torch CUDA cache, registered where torch allocated it,
and the server's pinned pool; the Rust figures come from
`kvring-bench kv --backend cuda` (the same geometry, layout and copy
threads), the ceilings from its pinned cuMemcpy each way.

A benchmark: it measures and asserts only that the bytes round trip.
"""

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import kvring

CHUNK = 256
CHUNKS = 24


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def start_server(copy_threads: int, pool_mib: int, backend: str = "host"):
    name = f"bench-py-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    d = tempfile.mkdtemp(prefix="kvring-bench-py-")
    os.chmod(d, 0o700)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvring", "serve", "--name", name, "--runtime-dir", d,
         "--backend", backend, "--pool-bytes", f"{pool_mib}MiB", "--copy-threads",
         str(copy_threads), "--prefault"],
        stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            # Waits as the Rust benchmark's client does: spinning.
            return proc, name, d, kvring.Client(name, runtime_dir=d, connect_timeout=0.5,
                                                wait="spin")
        except kvring.NoServer:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise


def status_poll(c, n):
    job = c.delay_job(0.0, 60.0)
    st = job.status
    for _ in range(10_000):
        st()
    clock = time.perf_counter_ns
    timer = []
    for _ in range(n):
        t = clock()
        timer.append(clock() - t)
    each = []
    for _ in range(n):
        t = clock()
        st()
        each.append(clock() - t)
    t = clock()
    for _ in range(n):
        st()
    batch = (clock() - t) / n
    assert st().state == "running"
    job.release()
    return {"p50": pct(each, 0.5), "p99": pct(each, 0.99), "batch_mean": batch,
            "timer_ns_p50": pct(timer, 0.5), "samples": n}


def lookup_latency(c, n):
    layout = kvring.Layout.preset("lbnhc", layers=1, blocks=128 * 16, block_tokens=16, heads=1,
                                  head_dim=8, elem_bytes=2)
    buf = (ctypes.c_uint8 * layout.allocations[0])()
    model = kvring.model_id("bench-small")
    reg = c.register_process_memory(layout, [ctypes.addressof(buf)], model_id=model)
    hashes = kvring.chunk_hashes([i ^ 0x5555 for i in range(128 * CHUNK)], CHUNK)
    assert c.store(reg, hashes, list(range(128 * 16))).wait(60).ok
    lat, polled = [], []
    clock = time.perf_counter_ns
    for i in range(n + n // 10):
        t = clock()
        lease = c.lookup(model, 1, hashes)
        e = clock() - t
        assert lease.hits == 128
        lease.end()
        t = clock()
        lease = c.submit_lookup(model, 1, hashes).poll()
        ep = clock() - t
        assert lease is not None and lease.hits == 128
        lease.end()
        if i >= n // 10:
            lat.append(e)
            polled.append(ep)
    c.unregister(reg)
    us = lambda xs: {"p50": pct(xs, 0.5) / 1e3, "p99": pct(xs, 0.99) / 1e3}  # noqa: E731
    return {**us(lat), "submit_poll_us": us(polled), "samples": n, "chunks": 128}


def store_and_retrieve(c, reg, model, chunks, src, dst, passes):
    """Median GB/s of a STORE of `chunks` chunks from blocks `src` and of a
    RETRIEVE of them into blocks `dst`, submit to done, over `passes`
    passes after a warm-up (the pool cleared before each)."""
    hashes = kvring.chunk_hashes([i * 7919 % (1 << 31) for i in range(chunks * CHUNK)], CHUNK)
    total = chunks * reg.layout.object_bytes(CHUNK)
    store, retrieve = [], []
    for p in range(passes + 1):
        c.clear()
        t = time.perf_counter_ns()
        st = c.store(reg, hashes, src).wait(120)
        ts = time.perf_counter_ns() - t
        assert st.ok and st.value == chunks, st
        lease = c.lookup(model, 1, hashes)
        assert lease.hits == chunks
        t = time.perf_counter_ns()
        st = c.retrieve(reg, lease.id, dst).wait(120)
        tr = time.perf_counter_ns() - t
        assert st.ok, st
        lease.end()
        if p > 0:
            store.append(total / ts)
            retrieve.append(total / tr)
    return statistics.median(store), statistics.median(retrieve)


def data_path(c, passes):
    blocks_per_chunk = CHUNK // 16
    nblocks = CHUNKS * blocks_per_chunk * 2
    layout = kvring.Layout.preset("lbnhc", layers=32, blocks=nblocks, block_tokens=16, heads=8,
                                  head_dim=128, elem_bytes=2)
    size = layout.allocations[0]
    buf = (ctypes.c_uint8 * size)()
    base = ctypes.addressof(buf)
    page = layout.page_bytes
    model = kvring.model_id("bench-llama-3-8b-py")
    reg = c.register_process_memory(layout, [base], model_id=model)
    perm = list(range(nblocks))
    random.Random(1).shuffle(perm)
    n = CHUNKS * blocks_per_chunk
    src, dst = perm[:n], perm[n:2 * n]
    rng = random.Random(2)
    view = memoryview(buf).cast("B")
    for layer in range(32):
        for b in src:
            at = (layer * nblocks + b) * page
            view[at:at + page] = rng.randbytes(64) * (page // 64)
    total = CHUNKS * layout.object_bytes(CHUNK)
    store, retrieve = store_and_retrieve(c, reg, model, CHUNKS, src, dst, passes)
    for layer in range(32):
        for s, d in zip(src, dst):
            a, b = (layer * nblocks + s) * page, (layer * nblocks + d) * page
            assert view[a:a + page] == view[b:b + page], (layer, s, d)
    c.unregister(reg)
    return store, retrieve, total


def data_path_cuda(c, passes):
    """The same jobs from a torch CUDA cache (registered where torch
    allocated it), as `kvring-bench kv --backend cuda` runs them: 64 chunks
    (2 GiB) of Llama-3-8B KV between random blocks of a 4 GiB LBNHC cache
    and the pool; every retrieved byte checked on the device."""
    import torch

    chunks, nblocks = 64, 2048
    layout = kvring.Layout.preset("lbnhc", layers=32, blocks=nblocks, block_tokens=16, heads=8,
                                  head_dim=128, elem_bytes=2)
    cache = torch.randint(0, 256, (layout.allocations[0],), dtype=torch.uint8, device="cuda")
    model = kvring.model_id("bench-llama-3-8b-py-cuda")
    reg = c.register_cuda_memory(layout, [cache.data_ptr()], model_id=model)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1))
    n = chunks * CHUNK // 16
    src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
    total = chunks * layout.object_bytes(CHUNK)
    torch.cuda.synchronize()
    store, retrieve = store_and_retrieve(c, reg, model, chunks, src, dst, passes)
    pages = cache.view(32, nblocks, layout.page_bytes)
    assert torch.equal(pages[:, dst], pages[:, src])
    c.unregister(reg)
    return store, retrieve, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rust-bench", help="kvring-bench binary (the Rust client's run)")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--polls", type=int, default=200_000)
    ap.add_argument("--lookups", type=int, default=5_000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--backend", choices=["host", "cuda"], default="host",
                    help="cuda: the data path from a torch CUDA cache (needs torch and a GPU)")
    args = ap.parse_args()
    ncpu = os.cpu_count() or 1
    cuda = args.backend == "cuda"
    # CUDA: the Rust benchmark's default copy threads there.
    threads = min(4, ncpu - 1) if cuda else max(1, min(32, ncpu - 1))
    pool_mib = 2304 if cuda else CHUNKS * 32 + 256
    proc, name, d, c = start_server(threads, pool_mib, args.backend)
    try:
        poll = status_poll(c, args.polls)
        print(f"status poll: p50 {poll['p50']} ns, p99 {poll['p99']} ns (timer alone "
              f"{poll['timer_ns_p50']} ns), batch mean {poll['batch_mean']:.0f} ns", file=sys.stderr)
        lookup = lookup_latency(c, args.lookups)
        sp = lookup["submit_poll_us"]
        print(f"lookup of 128 chunks: p50 {lookup['p50']:.1f} us, p99 {lookup['p99']:.1f} us; "
              f"submit + poll p50 {sp['p50']:.1f} us, p99 {sp['p99']:.1f} us", file=sys.stderr)
        store, retrieve, total = (data_path_cuda if cuda else data_path)(c, args.passes)
        print(f"python: store {store:.2f} GB/s, retrieve {retrieve:.2f} GB/s "
              f"({total >> 20} MiB per job)", file=sys.stderr)
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)
        subprocess.run(["rm", "-rf", d], check=False)
    out = {"bench": "python", "backend": args.backend, "copy_threads": threads, "status_poll_ns": poll,
           "lookup_us": lookup, "python": {"store_gbps": store, "retrieve_gbps": retrieve}}
    if args.rust_bench:
        memory = ["--backend", "cuda"] if cuda else ["--memory", "process"]
        r = subprocess.run([args.rust_bench, "kv", *memory, "--passes", str(args.passes),
                            "--lookups", str(args.lookups), "--copy-threads", str(threads),
                            "--json"], capture_output=True, text=True, check=True)
        rust = json.loads(r.stdout.strip().splitlines()[-1])
        if cuda:
            # The ceiling: one large pinned cuMemcpy each way.
            ceiling = rust["pinned_memcpy_gbps"]
            out["rust"] = {k: rust[k] for k in ("store_gbps", "retrieve_gbps", "pinned_memcpy_gbps")}
            store_ceiling, retrieve_ceiling = ceiling["d2h"], ceiling["h2d"]
        else:
            out["rust"] = {k: rust[k] for k in ("store_gbps", "retrieve_gbps", "memcpy_gbps")}
            out["rust"]["lookup_us"] = rust["lookup_us"]
            store_ceiling = retrieve_ceiling = rust["memcpy_gbps"]
        out["ratios"] = {
            "python_over_rust_store": store / rust["store_gbps"],
            "python_over_rust_retrieve": retrieve / rust["retrieve_gbps"],
            "store_over_ceiling": store / store_ceiling,
            "retrieve_over_ceiling": retrieve / retrieve_ceiling,
        }
        if "lookup_us" in rust:
            out["ratios"]["python_over_rust_lookup_p50"] = lookup["p50"] / rust["lookup_us"]["p50"]
        print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items()),
              file=sys.stderr)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
