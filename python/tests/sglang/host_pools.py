"""SGLang's host KV pools as SGLang 0.5.16 lays them out
(`mem_cache/pool_host/mha.py`, `mla.py`): one CPU tensor `kv_buffer` of the
dimensions each `hicache_mem_layout` gives, in an anonymous shared mapping
as SGLang allocates it (unpinned: there is no CUDA here), and
`get_page_buffer_meta`, SGLang's own account of where
a page's bytes lie, which the tests read pages through."""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

import torch

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass
class DevicePool:
    dtype: torch.dtype


class HostPool:
    """`MHATokenToKVPoolHost` (K and V of `heads` heads of `head_dim`) or,
    with `mla`, `MLATokenToKVPoolHost` (one latent of `head_dim`)."""

    def __init__(self, layout: str, *, mla: bool = False, layers: int = 3, heads: int = 2,
                 head_dim: int = 40, page_size: int = 64, pages: int = 12,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.mla, self.page_size = layout, mla, page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num, self.head_dim = layers, head_dim
        self.head_num = 1 if mla else heads
        self.kv_cache_dim = head_dim
        self.dtype = dtype
        self.device_pool = DevicePool(dtype)
        L, S, H, D, P, N = layers, self.size, self.head_num, head_dim, page_size, pages
        if mla:
            dims = {"layer_first": (L, S, 1, D), "page_first": (S, L, 1, D),
                    "page_first_direct": (N, L, P, 1, D)}[layout]
        else:
            dims = {"layer_first": (2, L, S, H, D), "page_first": (2, S, L, H, D),
                    "page_first_direct": (2, N, L, P, H, D), "page_head": (2, N, H, P, L, D)}[layout]
        # As SGLang allocates it (`mem_cache/mmap_allocator.py`): an
        # anonymous shared mapping (which it then pins with cudaHostRegister).
        nbytes = dtype.itemsize
        for d in dims:
            nbytes *= d
        self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.kv_buffer = torch.frombuffer(self._mapping, dtype=torch.uint8).view(dtype).view(dims)

    def slots(self, pages: list[int]) -> torch.Tensor:
        """The host indices of `pages`, as SGLang passes them."""
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]).to(torch.int64)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        base, e = self.kv_buffer.data_ptr(), self.dtype.itemsize
        idx = indices.tolist()
        L, S, H, D, P = self.layer_num, self.size, self.head_num, self.head_dim, self.page_size
        ptrs: list[int] = []
        if self.mla:
            if self.layout == "layer_first":
                for i in range(0, len(idx), P):
                    ptrs += [base + idx[i] * D * e + layer * S * D * e for layer in range(L)]
                size = P * D * e
            else:
                ptrs = [base + idx[i] * L * D * e for i in range(0, len(idx), P)]
                size = L * P * D * e
            return ptrs, [size] * len(ptrs)
        v_offset = L * S * H * D * e
        if self.layout == "layer_first":
            for i in range(0, len(idx), P):
                for layer in range(L):
                    k = base + idx[i] * H * D * e + layer * S * H * D * e
                    ptrs += [k, k + v_offset]
            size = P * H * D * e
        else:
            for i in range(0, len(idx), P):
                k = base + idx[i] * L * H * D * e
                ptrs += [k, k + v_offset]
            size = L * P * H * D * e
        return ptrs, [size] * len(ptrs)

    def page_bytes(self, page: int) -> bytes:
        """Page `page`'s bytes, read where SGLang says they lie."""
        ptrs, sizes = self.get_page_buffer_meta(self.slots([page]))
        return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))

    def page_tensor(self, page: int) -> torch.Tensor:
        """Page `page` as `[kv, layer, token, head, dim]` (MLA: `[layer,
        token, 1, dim]`) whatever the layout: pages of two layouts compare."""
        b, P = self.kv_buffer, self.page_size
        tokens = slice(page * P, (page + 1) * P)
        if self.mla:
            t = {"layer_first": lambda: b[:, tokens], "page_first": lambda: b[tokens].permute(1, 0, 2, 3),
                 "page_first_direct": lambda: b[page]}[self.layout]()
        else:
            t = {"layer_first": lambda: b[:, :, tokens], "page_first": lambda: b[:, tokens].permute(0, 2, 1, 3, 4),
                 "page_first_direct": lambda: b[:, page],
                 "page_head": lambda: b[:, page].permute(0, 3, 2, 1, 4)}[self.layout]()
        return t.contiguous()

    def fill_page(self, page: int, seed: int) -> None:
        """Random bytes in page `page`, written where SGLang says it lies."""
        g = torch.Generator().manual_seed(seed)
        ptrs, sizes = self.get_page_buffer_meta(self.slots([page]))
        for p, n in zip(ptrs, sizes):
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
            ctypes.memmove(p, data, n)

    def poison(self, byte: int = 0xA5) -> None:
        self.kv_buffer.view(torch.uint8).fill_(byte)

    def poison_pages(self, pages: list[int], byte: int = 0xA5) -> None:
        ptrs, sizes = self.get_page_buffer_meta(self.slots(pages))
        for p, n in zip(ptrs, sizes):
            ctypes.memset(p, byte, n)
