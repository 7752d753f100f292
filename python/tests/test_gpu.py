"""The Python API with real torch CUDA tensors and streams (skipped without
a GPU): an engine's torch stream ordered after a RETRIEVE by the job's word,
and never held by a server that was killed."""

import os
import signal
import time
import uuid

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


def device_uuid(index: int) -> bytes:
    u = torch.cuda.get_device_properties(index).uuid
    return bytes(u.bytes) if hasattr(u, "bytes") else uuid.UUID(str(u)).bytes


def cache_and_lease(c):
    """A KV cache in a torch CUDA tensor, registered by its CUDA IPC
    handle; one chunk stored from blocks 0-3 (bytes 0x11), a lease on it."""
    layout = kvring.Layout.preset("lbnhc", layers=2, blocks=64, block_tokens=16, heads=2,
                                  head_dim=32, elem_bytes=2)
    cache = torch.zeros(layout.allocations[0], dtype=torch.uint8, device="cuda")
    storage = cache.untyped_storage()
    # torch's versioned handle: version, type ('c': a cudaMalloc block),
    # then the block's 64-byte cudaIpcMemHandle; the storage's offset in it.
    _, handle, _, offset, *_ = storage._share_cuda_()
    assert handle[1:2] == b"c", handle[:2]
    offset += cache.data_ptr() - storage.data_ptr()
    reg = c.register_cuda_ipc(layout, [(bytes(handle[2:66]), offset)], model_id=MODEL,
                              device=device_uuid(cache.device.index))
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
