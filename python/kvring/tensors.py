"""Describing an engine's torch KV cache tensors as a kvring `Layout`.

An engine hands its connector one tensor per attention layer (vLLM's
`register_kv_caches`). kvring needs the allocations behind them and, per
layer, where each (block, head, token) row of K and of V starts. This module
reads that from the tensors themselves (their storages, offsets, shapes and
strides), so it follows whatever dtype, block size and memory order the
engine picked instead of assuming one.

Tensor shapes understood (logical shape; any strides, last dim contiguous):

- `[blocks, heads, tokens, k + v]`: K and V side by side in one row (vLLM
  0.26 and later, the CPU backend of 0.32, the strided views of 0.33/0.34;
  MLA as heads = 1, v = 0);
- `[blocks, tokens, k]`: MLA's latent cache of vLLM 0.26 (no V);
- `[blocks, 2, tokens, heads, d]`: FlashAttention of vLLM 0.24;
- `[2, blocks, tokens, heads, d]`: FlashAttention of vLLM 0.21.

A kernel whose block interior is its own (vLLM's CPU attention stores K
transposed, differently per ISA) is better described with
`describe_opaque_blocks`: each block is then copied as one run of bytes.

Importing this module imports torch; `import kvring` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvring import Client, KvringError, Layout, Registration

Placement = tuple[int, int, int, int, int, int]


class KvCacheUnsupported(KvringError, NotImplementedError):
    """The KV cache lives where or is shaped how kvring cannot register it
    (yet); `str(e)` says what and why."""


@dataclass(frozen=True)
class KvGeometry:
    """What the engine's configuration says each layer's tensor holds (per
    rank): the tensors are checked against it, so that a shape that merely
    looks similar is never taken for another."""

    block_tokens: int
    heads: int
    k_width: int
    v_width: int


@dataclass(frozen=True)
class KvCacheMemory:
    """A KV cache as kvring registers it: the layout, the base address of
    each of its allocations, and the tensors (kept referenced, so the memory
    stays alive as long as it may be registered)."""

    layout: Layout
    addresses: list[int]
    device: torch.device
    tensors: tuple[torch.Tensor, ...]


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], geometry: KvGeometry, *, shared: bool = False
) -> KvCacheMemory:
    """The layout of `kv_caches` (layer name -> tensor, in layer order).

    One kvring allocation per distinct backing storage (vLLM 0.32 and later
    give every layer a view of a single buffer; older versions one buffer
    per layer) and one placement per layer. The tensors may be host (CPU)
    or CUDA tensors; `register_kv_cache_memory` registers either. Raises
    `KvCacheUnsupported` for other devices and for shapes this module does
    not know, `KvringError` when the layers disagree with each other.
    """
    if not kv_caches:
        raise KvringError("no KV cache tensors to register")
    tensors = tuple(kv_caches.values())
    first = tensors[0]
    if first.device.type not in ("cpu", "cuda"):
        raise KvCacheUnsupported(
            f"the KV cache is on {first.device}: kvring registers host (CPU) and CUDA KV caches"
        )
    storage_index: dict[int, int] = {}
    allocations: list[int] = []
    addresses: list[int] = []
    placements: list[Placement] = []
    blocks = None
    for name, t in kv_caches.items():
        if t.device != first.device or t.dtype != first.dtype:
            raise KvringError(
                f"layer {name}: {t.dtype} on {t.device}, but the first layer is {first.dtype} on {first.device}"
            )
        alloc, offset = _allocation_of(t, storage_index, allocations, addresses)
        layer_blocks, placement = _placement(name, t, geometry, offset)
        if blocks is None:
            blocks = layer_blocks
        elif layer_blocks != blocks:
            raise KvringError(f"layer {name} has {layer_blocks} blocks, the first {blocks}")
        placements.append((alloc, *placement))
    layout = Layout(
        layers=len(placements),
        blocks=blocks,
        block_tokens=geometry.block_tokens,
        heads=geometry.heads,
        k_width=geometry.k_width,
        v_width=geometry.v_width,
        elem_bytes=first.element_size(),
        allocations=allocations,
        placements=placements,
        shared=shared,
    )
    return KvCacheMemory(layout, addresses, first.device, tensors)


def register_kv_cache_memory(
    client: Client, memory: KvCacheMemory, *, model_id: int, world_size: int = 1, rank: int = 0
) -> Registration:
    """Registers a described KV cache where it lives: host tensors as this
    process's memory, CUDA tensors as the engine's own device memory (the
    driver finds each allocation and how to share it)."""
    if memory.device.type == "cuda":
        return client.register_cuda_memory(
            memory.layout, memory.addresses, model_id=model_id, world_size=world_size, rank=rank
        )
    return client.register_process_memory(
        memory.layout, memory.addresses, model_id=model_id, world_size=world_size, rank=rank
    )


def _allocation_of(
    t: torch.Tensor, storage_index: dict[int, int], allocations: list[int], addresses: list[int]
) -> tuple[int, int]:
    """(allocation index, byte offset) of `t` in its backing storage; a
    storage not seen yet becomes the next allocation."""
    storage = t.untyped_storage()
    base = storage.data_ptr()
    if base not in storage_index:
        storage_index[base] = len(allocations)
        allocations.append(storage.nbytes())
        addresses.append(base)
    return storage_index[base], t.data_ptr() - base


def describe_opaque_blocks(kv_caches: Mapping[str, torch.Tensor], geometry: KvGeometry) -> KvCacheMemory:
    """The layout of `kv_caches` when each block of each layer is opaque
    bytes: every layer's tensor is `[blocks, ...]` with each block contiguous
    and exactly one block of `geometry` (vLLM's CPU cache, `[B, H, N, 2D]`,
    whose interior only its kernel knows). A block is described as
    `block_tokens` rows of equal size (one "head", the row's halves as K and
    V), so the server copies it as one run and puts it back byte for byte;
    only engines whose block bytes mean the same (the connector's model id
    says so) share the objects. Raises `KvCacheUnsupported` when a block is
    not contiguous or not one block's bytes (K and V outermost, say: then
    `describe_kv_caches`)."""
    block_tokens = geometry.block_tokens
    if not kv_caches:
        raise KvringError("no KV cache tensors to register")
    first = next(iter(kv_caches.values()))
    if first.device.type != "cpu":
        raise KvCacheUnsupported(f"opaque blocks are for host KV caches, not {first.device}")
    es = first.element_size()
    storage_index: dict[int, int] = {}
    allocations: list[int] = []
    addresses: list[int] = []
    placements: list[Placement] = []
    blocks = None
    row = None
    for name, t in kv_caches.items():
        if t.device != first.device or t.dtype != first.dtype:
            raise KvringError(
                f"layer {name}: {t.dtype} on {t.device}, but the first layer is {first.dtype} on {first.device}"
            )
        inner = t[0] if t.dim() > 1 else None
        if inner is None or not inner.is_contiguous():
            raise KvCacheUnsupported(
                f"layer {name}: shape {tuple(t.shape)} strides {t.stride()}: a block is not contiguous"
            )
        block_bytes = inner.numel() * es
        want = geometry.heads * block_tokens * (geometry.k_width + geometry.v_width) * es
        if block_bytes != want or block_bytes % (2 * block_tokens * es):
            raise KvCacheUnsupported(
                f"layer {name}: shape {tuple(t.shape)}: t[b] is {block_bytes} bytes, one block of "
                f"{geometry} is {want}"
            )
        layer_row = block_bytes // block_tokens
        if row is None:
            row, blocks = layer_row, t.shape[0]
        elif (layer_row, t.shape[0]) != (row, blocks):
            raise KvringError(f"layer {name}: {t.shape[0]} blocks of {block_bytes} bytes, unlike the first")
        alloc, offset = _allocation_of(t, storage_index, allocations, addresses)
        placements.append((alloc, offset, offset + row // 2, t.stride(0) * es, 0, row))
    half = row // (2 * es)
    layout = Layout(
        layers=len(placements),
        blocks=blocks,
        block_tokens=block_tokens,
        heads=1,
        k_width=half,
        v_width=half,
        elem_bytes=es,
        allocations=allocations,
        placements=placements,
    )
    return KvCacheMemory(layout, addresses, first.device, tuple(kv_caches.values()))


def _placement(name: str, t: torch.Tensor, g: KvGeometry, offset: int) -> tuple[int, tuple[int, int, int, int, int]]:
    """(blocks, (k_offset, v_offset, block_stride, head_stride, token_stride))
    of one layer's tensor, in bytes; `offset` is where the tensor starts in
    its allocation."""
    es = t.element_size()
    shape, stride = tuple(t.shape), tuple(s * es for s in t.stride())
    width = g.k_width + g.v_width
    if t.dim() == 4 and shape[1:] == (g.heads, g.block_tokens, width) and t.stride(3) == 1:
        # [B, H, N, K|V]: V starts k_width elements into each row (MLA,
        # [B, 1, N, latent]: no V, whose offset is then 0 by the layout's rule).
        v = offset + g.k_width * es if g.v_width else 0
        return shape[0], (offset, v, stride[0], stride[1], stride[2])
    if (
        t.dim() == 3
        and g.heads == 1
        and g.v_width == 0
        and shape[1:] == (g.block_tokens, g.k_width)
        and t.stride(2) == 1
    ):
        # [B, N, K] (MLA): one "head"; its stride is never used; no V.
        return shape[0], (offset, 0, stride[0], 0, stride[1])
    row = (g.block_tokens, g.heads, g.k_width)
    if t.dim() == 5 and g.k_width == g.v_width and t.stride(4) == 1:
        if shape[0] == 2 and shape[2:] == row:
            # [2, B, N, H, D]: V is the second half of the outermost dim.
            return shape[1], (offset, offset + stride[0], stride[1], stride[3], stride[2])
        if shape[1] == 2 and shape[2:] == row:
            # [B, 2, N, H, D]: K and V alternate per block.
            return shape[0], (offset, offset + stride[1], stride[0], stride[3], stride[2])
    raise KvCacheUnsupported(
        f"layer {name}: a KV cache tensor of shape {shape} and strides {t.stride()} "
        f"({t.dtype}) does not match {g} in any shape kvring knows "
        "([B,H,N,K+V], [B,N,K], [2,B,N,H,D], [B,2,N,H,D], last dim contiguous)"
    )
