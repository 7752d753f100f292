"""KV caches allocated the way vLLM's versions allocate them, as the dict of
layer name -> tensor that `register_kv_caches` receives.

- vLLM 0.33/0.34 (`allocate_kv_cache`, `create_kv_cache_views`): ONE int8
  buffer for every layer; each layer a `torch.as_strided` view
  `[B, H, N, C]` (blocks, KV heads, tokens per block, head_size +
  head_size_v with K first and V second in the same row) of the int8
  storage, converted to the cache dtype with `.view(dtype)`. Where each
  (layer, block, token, head) row lies is the physical order, named as
  vLLM's `KVCacheLayout` names it (LBNHC: layer outermost, then block,
  token, head, C; BLNHC: block outermost, every layer of a block in one
  run). MLA: H = 1, head_size_v = 0, C = latent + rope (576).
- vLLM 0.26 (FlashAttention, NHD stride order): a tensor per layer, logical
  `(B, H, N, 2D)` as a permuted view of a physically `[B, N, H, 2D]` one.
- vLLM 0.21 (FlashAttention): a tensor per layer, `(2, B, N, H, D)`.

The memory comes from one of three allocators (`ALLOC_KINDS`): torch's
caching allocator (cudaMalloc blocks; plain host tensors on CPU), torch's
expandable segments (the same code in a process started with
`ALLOC_ENV["expandable"]`: VMM memory mapped in 20 MiB chunks), or one
`cuMemCreate` allocation exportable as a POSIX fd, reserved, mapped and made
accessible as vLLM 0.34's extensible KV cache does (`CuMemAllocation`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LAYER_NAME = "model.layers.{}.self_attn.attn"

ALLOC_KINDS = ("caching", "expandable", "cumem")
CUDA_ONLY_KINDS = ("expandable", "cumem")
ALLOC_ENV = {"expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
"""Environment a kind's processes start with (before torch initialises CUDA)."""


@dataclass(frozen=True)
class LayoutCase:
    """A vLLM version's KV cache shape: `vllm` "0.33" (0.33/0.34 views of one
    buffer, in physical `order`), "0.26" or "0.21" (a tensor per layer)."""

    name: str
    vllm: str
    order: str = "LBNHC"
    fp8: bool = False
    mla: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8 else torch.bfloat16

    @property
    def cache_dtype(self) -> str:
        """vLLM's `cache_config.cache_dtype` for it."""
        return "fp8" if self.fp8 else "auto"


LAYOUT_CASES = {
    c.name: c
    for c in (
        LayoutCase("0.33-LBNHC-bf16", "0.33", "LBNHC"),
        LayoutCase("0.33-LBHNC-bf16", "0.33", "LBHNC"),
        LayoutCase("0.33-BLNHC-bf16", "0.33", "BLNHC"),
        LayoutCase("0.33-BLHNC-bf16", "0.33", "BLHNC"),
        LayoutCase("0.33-LBNHC-fp8", "0.33", "LBNHC", fp8=True),
        LayoutCase("0.33-LBHNC-fp8", "0.33", "LBHNC", fp8=True),
        LayoutCase("0.33-BLNHC-fp8", "0.33", "BLNHC", fp8=True),
        LayoutCase("0.33-LBNHC-mla", "0.33", "LBNHC", mla=True),
        LayoutCase("0.26-NHD-bf16", "0.26"),
        LayoutCase("0.21-flash-bf16", "0.21"),
    )
}


@dataclass(frozen=True)
class KvSpec:
    """One rank's KV cache: `heads` are this rank's KV heads; `head_size_v`
    is 0 for MLA (C = head_size)."""

    layers: int
    blocks: int
    block_tokens: int
    heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row, K then V."""
        return (self.head_size + self.head_size_v) * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.layers * self.heads * self.block_tokens * self.row_bytes


@dataclass
class KvCache:
    """The tensors handed to `register_kv_caches`, the int8 allocations
    behind them, and what releases those allocations."""

    tensors: dict[str, torch.Tensor]
    buffers: list[torch.Tensor]
    spec: KvSpec
    _releases: list[Callable[[], None]] = field(default_factory=list)

    def token_rows(self, layer: int) -> list[tuple[torch.Tensor, int]]:
        """Layer `layer` as int8 views `[B, N, H, W]` (block, token in
        block, head, bytes) with the byte offset of each view's W bytes in a
        (token, head) row: one view where K and V share a row, two (K, V)
        for vLLM 0.21's `(2, B, N, H, D)`."""
        t = list(self.tensors.values())[layer]
        if t.dim() == 4:  # [B, H, N, C]
            return [(t.view(torch.int8).permute(0, 2, 1, 3), 0)]
        k_bytes = self.spec.head_size * self.spec.dtype.itemsize
        return [(t[0].view(torch.int8), 0), (t[1].view(torch.int8), k_bytes)]

    def release(self) -> None:
        """Frees allocations made outside torch (after the tensors are gone)."""
        self.tensors.clear()
        self.buffers.clear()
        for release in self._releases:
            release()
        self._releases.clear()


def allocate_kv_cache(
    case: LayoutCase, spec: KvSpec, device: torch.device, kind: str, *, export_fd: bool = True
) -> KvCache:
    """Allocates `spec` as `case`'s vLLM version does, on `device`, from
    `kind`'s allocator; `export_fd`: a "cumem" allocation is requested with
    the POSIX fd handle type (vLLM 0.34 does so when a connector declares
    `KVCacheAccess.EXPORTS_FD`)."""
    if kind not in ALLOC_KINDS:
        raise ValueError(f"unknown allocation kind {kind!r}")
    if kind in CUDA_ONLY_KINDS and device.type != "cuda":
        raise ValueError(f"{kind} allocations are CUDA memory, not {device}")
    cache = KvCache({}, [], spec)

    def int8_zeros(nbytes: int) -> torch.Tensor:
        if kind == "cumem":
            alloc = CuMemAllocation(nbytes, device.index or 0, export_fd=export_fd)
            cache._releases.append(alloc.release)
            buf = torch.as_tensor(alloc, device=device)[:nbytes]
            buf.zero_()
        else:
            buf = torch.zeros(nbytes, dtype=torch.int8, device=device)
        cache.buffers.append(buf)
        return buf

    s, es = spec, spec.dtype.itemsize
    names = [LAYER_NAME.format(i) for i in range(s.layers)]
    if case.vllm == "0.33":
        c = s.head_size + s.head_size_v
        strides = _strides(case.order, {"L": s.layers, "B": s.blocks, "N": s.block_tokens, "H": s.heads, "C": c * es})
        buf = int8_zeros(s.layers * s.blocks * s.heads * s.block_tokens * c * es)
        for i, name in enumerate(names):
            view = torch.as_strided(
                buf,
                (s.blocks, s.heads, s.block_tokens, c * es),
                (strides["B"], strides["H"], strides["N"], 1),
                i * strides["L"],
            )
            cache.tensors[name] = view.view(s.dtype)
    elif case.vllm == "0.26":
        d2 = 2 * s.head_size
        for name in names:
            raw = int8_zeros(s.blocks * s.block_tokens * s.heads * d2 * es)
            cache.tensors[name] = raw.view(s.dtype).view(s.blocks, s.block_tokens, s.heads, d2).permute(0, 2, 1, 3)
    elif case.vllm == "0.21":
        for name in names:
            raw = int8_zeros(2 * s.blocks * s.block_tokens * s.heads * s.head_size * es)
            cache.tensors[name] = raw.view(s.dtype).view(2, s.blocks, s.block_tokens, s.heads, s.head_size)
    else:
        raise ValueError(f"no vLLM {case.vllm} layout")
    return cache


def _strides(order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Byte strides of the dims of `order` (outermost first; C in bytes)."""
    if sorted(order) != sorted("LBNHC") or order[-1] != "C":
        raise ValueError(f"not a KV cache layout: {order}")
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    return strides


def in_expandable_segment(t: torch.Tensor) -> bool:
    """Whether torch's allocator served `t` from an expandable segment."""
    ptr = t.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable"))
    return False


# ---------------------------------------------------------------- cuMem


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CuMemAllocation:
    """One `cuMemCreate` allocation (requested with
    `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` when `export_fd`), reserved,
    mapped and made read-write for its device with `cuMemAddressReserve` /
    `cuMemMap` / `cuMemSetAccess`, as vLLM 0.34's extensible KV cache does
    (its size rounded up to the driver's granularity).
    `torch.as_tensor(alloc, device="cuda")` wraps it as an int8 tensor
    through `__cuda_array_interface__` (the tensor keeps this object alive);
    `release()` unmaps and frees it, once no tensor uses it."""

    def __init__(self, nbytes: int, device_index: int, *, export_fd: bool = True) -> None:
        torch.cuda.init()
        torch.cuda.set_device(device_index)
        torch.zeros(1, device=f"cuda:{device_index}")  # the primary context, current
        self._cu = cu = _libcuda()
        prop = _CUmemAllocationProp(
            type=_CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes=_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if export_fd else 0,
            location=_CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device_index),
        )
        granularity = ctypes.c_size_t()
        _check(
            cu.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(prop), _CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        g = granularity.value
        self.size = (nbytes + g - 1) // g * g
        self._handle = ctypes.c_uint64()
        _check(cu.cuMemCreate(ctypes.byref(self._handle), self.size, ctypes.byref(prop), 0), "cuMemCreate")
        self._ptr = ctypes.c_uint64()
        try:
            _check(cu.cuMemAddressReserve(ctypes.byref(self._ptr), self.size, 0, 0, 0), "cuMemAddressReserve")
            _check(cu.cuMemMap(self._ptr, self.size, 0, self._handle, 0), "cuMemMap")
            access = _CUmemAccessDesc(
                _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device_index), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            _check(cu.cuMemSetAccess(self._ptr, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
        except BaseException:
            self.release()
            raise
        self.__cuda_array_interface__ = {
            "shape": (self.size,),
            "typestr": "|i1",
            "data": (self._ptr.value, False),
            "version": 3,
            "strides": None,
        }

    def release(self) -> None:
        """Unmaps, frees the address range and releases the memory (each
        step once)."""
        cu = self._cu
        if self._ptr.value:
            torch.cuda.synchronize()
            cu.cuMemUnmap(self._ptr, self.size)
            cu.cuMemAddressFree(self._ptr, self.size)
            self._ptr = ctypes.c_uint64()
        if self._handle.value:
            cu.cuMemRelease(self._handle)
            self._handle = ctypes.c_uint64()


def _libcuda() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    u64, size_t, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    cu.cuMemGetAllocationGranularity.argtypes = [ptr, ptr, ctypes.c_int]
    cu.cuMemCreate.argtypes = [ptr, size_t, ptr, u64]
    cu.cuMemAddressReserve.argtypes = [ptr, size_t, size_t, u64, u64]
    cu.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
    cu.cuMemSetAccess.argtypes = [u64, size_t, ptr, size_t]
    cu.cuMemUnmap.argtypes = [u64, size_t]
    cu.cuMemAddressFree.argtypes = [u64, size_t]
    cu.cuMemRelease.argtypes = [u64]
    return cu


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")
