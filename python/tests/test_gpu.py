"""The Python API with real torch CUDA tensors and streams (skipped without
a GPU): torch memory registered where it is, an engine's torch stream
ordered after a RETRIEVE by the job's word, and never held by a server that
was killed. (Expandable segments, one cuMemCreate allocation and vLLM's
layouts: `engine/`; a real model's KV: `test_gpu_model.py`.)"""

import os
import signal
import time

import pytest

import kvring
from conftest import Server

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

CHUNK = 64
MODEL = kvring.model_id("pytest-gpu-model")


@pytest.fixture
def cuda_server():
    s = Server("--chunk-tokens", "64", "--pool-bytes", "64MiB", "--copy-threads", "1",
               backend="cuda")
    yield s
    s.stop()


def cache_and_lease(c):
    """A KV cache in a torch CUDA tensor, registered where it is (the
    driver finds its cudaMalloc block from the address); one chunk stored
    from blocks 0-3 (bytes 0x11), a lease on it."""
    layout = kvring.Layout.preset("lbnhc", layers=2, blocks=64, block_tokens=16, heads=2,
                                  head_dim=32, elem_bytes=2)
    cache = torch.zeros(layout.allocations[0], dtype=torch.uint8, device="cuda")
    reg = c.register_cuda_memory(layout, [cache.data_ptr()], model_id=MODEL)
    page = layout.page_bytes
    for layer in range(2):
        base = layer * 64 * page
        cache[base:base + 4 * page] = 0x11
    torch.cuda.synchronize()
    hashes = kvring.chunk_hashes(list(range(CHUNK)), CHUNK)
    assert c.store(reg, hashes, [0, 1, 2, 3]).wait(10).ok
    lease = c.lookup(MODEL, 1, hashes)
    assert lease.hits == 1
    return cache, page, reg, lease


def test_a_tensor_inside_a_larger_cudamalloc_block_round_trips(cuda_server):
    """The cache is a view 1 MiB + 512 bytes into a larger tensor (as the
    caching allocator places tensors in its blocks): the registration
    finds the block and the offset; stored blocks come back byte for byte
    into other block ids, and nothing else in the block changes."""
    c = cuda_server.client()
    layout = kvring.Layout.preset("lbnhc", layers=3, blocks=32, block_tokens=16, heads=2,
                                  head_dim=64, elem_bytes=2)
    size = layout.allocations[0]
    big = torch.randint(0, 256, (size + 4 * 2**20,), dtype=torch.uint8, device="cuda")
    at = 2**20 + 512
    cache = big[at:at + size]
    before = big.clone()
    reg = c.register_cuda_memory(layout, [cache.data_ptr()], model_id=MODEL)
    hashes = kvring.chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    assert c.store(reg, hashes, list(range(8))).wait(10).ok
    lease = c.lookup(MODEL, 1, hashes)
    assert lease.hits == 2
    dst = [20, 9, 31, 12, 8, 25, 14, 30]
    assert c.retrieve(reg, lease.id, dst).wait(10).ok
    torch.cuda.synchronize()
    page = layout.page_bytes
    expect = before.clone()
    for layer in range(3):
        base = at + layer * 32 * page
        for src, d in zip(range(8), dst):
            expect[base + d * page:base + (d + 1) * page] = before[base + src * page:base + (src + 1) * page]
    assert torch.equal(big, expect)
    c.unregister(reg)
    c.close()


def test_memory_that_is_not_device_memory_is_refused_with_the_reason(cuda_server):
    c = cuda_server.client()
    layout = kvring.Layout.preset("lbnhc", layers=1, blocks=8, block_tokens=16, heads=1,
                                  head_dim=32, elem_bytes=2)
    host = torch.zeros(layout.allocations[0], dtype=torch.uint8)
    with pytest.raises(kvring.InvalidArgument, match="not CUDA device memory|not device memory"):
        c.register_cuda_memory(layout, [host.data_ptr()], model_id=MODEL)
    # A tensor of 64 MiB is a cudaMalloc block of its own: a layout that
    # starts 1 KiB before its end runs past it.
    block = torch.zeros(64 * 2**20, dtype=torch.uint8, device="cuda")
    with pytest.raises(kvring.InvalidArgument, match="runs past its allocation"):
        c.register_cuda_memory(layout, [block.data_ptr() + block.numel() - 1024], model_id=MODEL)
    c.close()


def busy_event(seconds):
    """An interprocess event that completes after a kernel busy for about
    `seconds` on a side stream: the server holds the job until then."""
    side = torch.cuda.Stream()
    ev = torch.cuda.Event(interprocess=True)
    rate = torch.cuda.get_device_properties(0).clock_rate * 1000  # Hz
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(seconds * rate))
    ev.record(side)
    return bytes(ev.ipc_handle()), side


def test_a_torch_stream_waits_for_a_retrieve_through_its_job_word(cuda_server):
    c = cuda_server.client()
    cache, page, reg, lease = cache_and_lease(c)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    handle, side = busy_event(0.5)
    # The retrieve waits for the engine's event (a busy kernel); the
    # engine's stream waits for the retrieve, then reads the blocks.
    job = c.retrieve(reg, lease.id, [8, 9, 10, 11], after=handle, timeout=30)
    with kvring.EngineStream(torch.cuda.current_device(), stream.cuda_stream) as es:
        es.wait_job(job)
        with torch.cuda.stream(stream):
            seen = cache[8 * page:12 * page].clone()
        after = torch.cuda.Event()
        after.record(stream)
        assert job.status().state == "pending", job.status()
        assert not after.query(), "the stream ran ahead of the job"
        t0 = time.monotonic()
        stream.synchronize()
        waited = time.monotonic() - t0
    st = job.status()
    assert st.ok, st
    assert waited > 0.1, waited
    # What the stream read after its wait is the retrieved chunk.
    assert bool((seen == 0x11).all())
    side.synchronize()
    c.close()


def test_a_torch_stream_reads_each_layer_group_once_it_landed(cuda_server):
    """A retrieve in two layer groups (one layer each) after a busy engine
    event: the stream waits for group 0, reads layer 0, waits for group 1,
    reads layer 1; it never runs ahead of either."""
    c = cuda_server.client()
    cache, page, reg, lease = cache_and_lease(c)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    handle, side = busy_event(0.5)
    job = c.retrieve(reg, lease.id, [8, 9, 10, 11], after=handle, timeout=30, layer_groups=2)
    assert job.layer_groups == 2
    seen = []
    with kvring.EngineStream(torch.cuda.current_device(), stream.cuda_stream) as es:
        for layer in range(2):
            es.wait_layer_group(job, layer)
            base = layer * 64 * page
            with torch.cuda.stream(stream):
                seen.append(cache[base + 8 * page:base + 12 * page].clone())
        with pytest.raises(kvring.KvringError, match="layer group 2"):
            es.wait_layer_group(job, 2)
        after = torch.cuda.Event()
        after.record(stream)
        assert not job.layer_group_landed(0), "landed before the engine's event"
        assert not after.query(), "the stream ran ahead of the job"
        stream.synchronize()
    assert job.wait(10).ok
    assert job.layer_group_landed(1)
    assert all(bool((s == 0x11).all()) for s in seen)
    side.synchronize()
    c.close()


def test_a_killed_server_never_holds_a_torch_stream(cuda_server):
    c = cuda_server.client()
    cache, page, reg, lease = cache_and_lease(c)
    # Made before the busy kernel: work on the default stream queued after
    # it would wait for it.
    marker = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    handle, side = busy_event(8.0)
    job = c.retrieve(reg, lease.id, [8, 9, 10, 11], after=handle, timeout=60)
    es = kvring.EngineStream(torch.cuda.current_device(), stream.cuda_stream)
    es.wait_job(job)
    with torch.cuda.stream(stream):
        marker.fill_(1)
    time.sleep(0.2)
    queued = torch.cuda.Event()
    queued.record(stream)
    assert not queued.query(), "the stream ran ahead of the job"
    t0 = time.monotonic()
    os.kill(cuda_server.proc.pid, signal.SIGKILL)
    stream.synchronize()
    released = time.monotonic() - t0
    # The client's watcher gives the job up when the server dies: far
    # sooner than the 8 s the engine's event takes, or the 60 s timeout.
    assert released < 4.0, released
    side.synchronize()
    assert marker.item() == 1
    assert job.released
    es.close()


def test_healthz_sees_a_retrieve_stuck_behind_an_engine_event():
    """The stuck-engine-event case that LMCache's health endpoint missed: a
    retrieve held behind an engine event that does not complete makes
    /healthz 503 (job_stuck) once it is older than --stuck-job-s, and 200
    again after the event completed and the job ended."""
    import json
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    srv = Server("--chunk-tokens", "64", "--pool-bytes", "64MiB", "--copy-threads", "1",
                 "--http", f"127.0.0.1:{port}", "--stuck-job-s", "1", backend="cuda")
    try:
        def healthz():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        c = srv.client()
        cache, page, reg, lease = cache_and_lease(c)
        assert healthz()[0] == 200
        handle, side = busy_event(4.0)
        job = c.retrieve(reg, lease.id, [8, 9, 10, 11], after=handle, timeout=60)
        time.sleep(1.5)
        code, body = healthz()
        assert code == 503, body
        assert [r["kind"] for r in body["reasons"]] == ["job_stuck"], body
        assert job.status().state == "pending"
        side.synchronize()
        assert job.wait(30).ok
        job.release()
        code, body = healthz()
        assert code == 200, body
        c.close()
    finally:
        srv.stop()
