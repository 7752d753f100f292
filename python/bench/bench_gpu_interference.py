"""What a kvring server's copies cost an engine's own kernels on the same
GPU, against what vLLM's offload does (host-to-device copies on a side
stream of the engine's process).

The engine (this process) times two kernel sequences with CUDA events:
`big_matmul_8192` (one 8192^3 bf16 matmul) and `step_16tok_32layers` (a
16-token step through 32 MLP-sized matmul pairs, the shape of a decode or a
short prefill), each alone, while a kvring server (CUDA backend, its own
process) retrieves 32 chunks of Llama-3-8B-geometry KV into this process's
cache in a loop, while this process copies 1 GiB of pinned memory to the
device on a side stream in a loop, and alone again. Medians and p99 over
300 and 200 runs, with the background's throughput. A server copies with
its own kernels in its own CUDA context: the GPU time-slices between the
two processes' contexts where both have work, which a copy engine
transfer inside the engine's process does not do.

    python bench_gpu_interference.py [SERVER ARGS...]   # e.g. --cuda-zero-copy-ctas 8

Writes `interfere[-ARGS].json` to $OUT (default /tmp). Needs torch with
CUDA and the kvring package.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

import kvring

CHUNK = 256
OUT = os.environ.get("OUT", "/tmp")
name = f"intf-{os.getpid()}"
d = tempfile.mkdtemp(prefix="kvring-intf-")
os.chmod(d, 0o700)
log = open(os.path.join(OUT, "interfere-server.log"), "w")
extra = sys.argv[1:]
proc = subprocess.Popen([sys.executable, "-m", "kvring", "serve", "--name", name, "--runtime-dir", d,
                         "--backend", "cuda", "--pool-bytes", "8GiB", "--chunk-tokens", str(CHUNK), *extra],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
deadline = time.monotonic() + 120
while True:
    try:
        kvring.Client(name, runtime_dir=d, connect_timeout=1.0).close()
        break
    except kvring.KvringError:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("server did not start")
        time.sleep(0.2)

stop = threading.Event()
try:
    MODEL = kvring.model_id("interfere")
    layout = kvring.Layout.preset("lbnhc", layers=32, blocks=2048, block_tokens=16, heads=8, head_dim=128, elem_bytes=2)
    cache = torch.zeros(layout.allocations[0], dtype=torch.uint8, device="cuda")
    c = kvring.Client(name, runtime_dir=d)
    reg = c.register_cuda_memory(layout, [cache.data_ptr()], model_id=MODEL)
    hashes = kvring.chunk_hashes(list(range(32 * CHUNK)), CHUNK)
    assert c.store(reg, hashes, list(range(512))).wait(30).ok

    moved = [0, 0.0]


    def kvring_loads():
        t0 = time.perf_counter()
        n = 0
        while not stop.is_set():
            lease = c.lookup(MODEL, 1, hashes)
            job = c.retrieve(reg, lease.id, list(range(1024, 1536)), timeout=30)
            assert job.wait(30).ok
            n += 1
        moved[0], moved[1] = n * layout.object_bytes(CHUNK) * 32, time.perf_counter() - t0


    pinned = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")


    def torch_h2d():
        s = torch.cuda.Stream()
        t0 = time.perf_counter()
        n = 0
        with torch.cuda.stream(s):
            while not stop.is_set():
                dev.copy_(pinned, non_blocking=True)
                s.synchronize()
                n += 1
        moved[0], moved[1] = n * (1 << 30), time.perf_counter() - t0


    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    x16 = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    w2 = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda")


    def big():
        a @ a


    def small():
        y = x16
        for _ in range(32):
            y = (y @ w) @ w2
            y = y / y.norm()


    def timed(fn, iters):
        ts = []
        for _ in range(iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ts.sort()
        return {"p50_ms": statistics.median(ts), "p99_ms": ts[int(0.99 * len(ts))], "min_ms": ts[0]}

    res = {"gpu": torch.cuda.get_device_name(0), "server_args": extra}
    for fn_name, fn, iters in (("big_matmul_8192", big, 300), ("step_16tok_32layers", small, 200)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        row = {"alone": timed(fn, iters)}
        for bg_name, bg in (("kvring_retrieves", kvring_loads), ("torch_h2d_side_stream", torch_h2d)):
            stop.clear()
            t = threading.Thread(target=bg)
            t.start()
            time.sleep(0.3)
            row[bg_name] = timed(fn, iters)
            stop.set()
            t.join()
            row[bg_name]["background_GBps"] = moved[0] / moved[1] / 1e9
        row["alone_after"] = timed(fn, iters)
        res[fn_name] = row
        print(fn_name, json.dumps(row), flush=True)
    tag = "".join("-" + a.strip("-") for a in extra)
    with open(os.path.join(OUT, f"interfere{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    c.close()
finally:
    stop.set()
    proc.terminate()
    proc.wait(10)
