"""kvring.tensors with real torch tensors: KV caches allocated as vLLM's
versions allocate them, described, registered by address with a real
server, and round-tripped byte for byte (store from some blocks, retrieve
into others)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvring  # noqa: E402
from kvring.tensors import (  # noqa: E402
    KvCacheUnsupported,
    KvGeometry,
    describe_kv_caches,
    describe_opaque_blocks,
)

LAYERS, BLOCKS, BS, HEADS, D = 2, 32, 16, 2, 8
CHUNK = 64
GEOM = KvGeometry(block_tokens=BS, heads=HEADS, k_width=D, v_width=D)


def one_buffer(shape_of_layer, dtype):
    """vLLM 0.32 (CPU) / 0.33+: one int8 buffer, each layer a view of it,
    64 bytes past a page boundary."""
    per = torch.Size(shape_of_layer).numel() * torch.tensor([], dtype=dtype).element_size()
    raw = torch.zeros(per * LAYERS + 64, dtype=torch.int8)[64:]
    return {f"model.layers.{i}.self_attn.attn": raw[i * per:(i + 1) * per].view(dtype).view(shape_of_layer)
            for i in range(LAYERS)}


def per_layer(shape_of_layer, dtype):
    """vLLM 0.21-0.26: a tensor per layer."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape_of_layer, dtype=dtype)
            for i in range(LAYERS)}


CASES = {
    "cpu-0.32-opaque": (lambda: one_buffer((BLOCKS, HEADS, BS, 2 * D), torch.bfloat16), True),
    "bhn(k|v)-one-buffer": (lambda: one_buffer((BLOCKS, HEADS, BS, 2 * D), torch.float32), False),
    "flash-attn-0.21": (lambda: per_layer((2, BLOCKS, BS, HEADS, D), torch.bfloat16), False),
    "flashinfer-0.24": (lambda: per_layer((BLOCKS, 2, BS, HEADS, D), torch.float16), False),
}


@pytest.fixture(scope="module")
def server(kvring_server_factory):
    return kvring_server_factory(pool_bytes="64MiB", chunk_tokens=CHUNK)


def block_bytes(caches, layer, block):
    t = list(caches.values())[layer]
    if t.shape[0] == 2 and t.dim() == 5:  # [2, B, ...]: K and V apart
        return bytes(t[:, block].contiguous().view(torch.uint8).flatten().tolist())
    return bytes(t[block].contiguous().view(torch.uint8).flatten().tolist())


@pytest.mark.parametrize("case", list(CASES))
def test_a_torch_kv_cache_round_trips_through_the_server(server, case):
    make, opaque = CASES[case]
    caches = make()
    for i, t in enumerate(caches.values()):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                generator=torch.Generator().manual_seed(i)))
    mem = describe_opaque_blocks(caches, GEOM) if opaque else describe_kv_caches(caches, GEOM)
    assert len(mem.addresses) == (1 if "one-buffer" in case or "opaque" in case else LAYERS)
    with server.client() as c:
        model = kvring.model_id(f"tensors-{case}")
        reg = c.register_process_memory(mem.layout, mem.addresses, model_id=model)
        hashes = kvring.chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        src, dst = list(range(0, 8)), list(range(16, 24))
        want = {(l, b): block_bytes(caches, l, b) for l in range(LAYERS) for b in src}
        assert c.store(reg, hashes, src).wait(10).ok
        with c.lookup(model, 1, hashes) as lease:
            assert lease.hits == 2
            assert c.retrieve(reg, lease.id, dst).wait(10).ok
        for l in range(LAYERS):
            for s_, d in zip(src, dst):
                assert block_bytes(caches, l, d) == want[l, s_], (case, l, s_, d)
        c.unregister(reg)


def test_shapes_it_does_not_know_are_refused_with_their_reason():
    odd = {"l0": torch.zeros((BLOCKS, BS, HEADS, 3 * D), dtype=torch.bfloat16)}
    with pytest.raises(KvCacheUnsupported, match="does not match"):
        describe_kv_caches(odd, GEOM)
    strided = {"l0": torch.zeros((HEADS, BLOCKS, BS, 2 * D), dtype=torch.bfloat16).transpose(0, 1)}
    with pytest.raises(KvCacheUnsupported, match="not contiguous"):
        describe_opaque_blocks(strided, GEOM)
    # K and V outermost: dim 0 is not the blocks.
    kv_outer = {"l0": torch.zeros((2, BLOCKS, BS, HEADS, D), dtype=torch.bfloat16)}
    with pytest.raises(KvCacheUnsupported, match="one block of"):
        describe_opaque_blocks(kv_outer, GEOM)


def test_a_cache_on_a_device_kvring_cannot_reach_is_refused():
    on_meta = {"l0": torch.zeros((BLOCKS, HEADS, BS, 2 * D), dtype=torch.bfloat16, device="meta")}
    with pytest.raises(KvCacheUnsupported, match="host .CPU. and CUDA"):
        describe_kv_caches(on_meta, GEOM)
