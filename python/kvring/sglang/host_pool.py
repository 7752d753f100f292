"""SGLang's host KV pool as kvring sees it: the strided layout of its one
buffer (the server copies pages in and out of it where it lies), and the
identity its pages are stored under.

SGLang's host pool (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`) is one
pinned CPU tensor, `kv_buffer`, indexed by token slot; a page is
`page_size` consecutive slots starting at a multiple of `page_size`. Its
dimensions, by `hicache_mem_layout`:

| layout | MHA (K and V) | MLA (one latent) |
|---|---|---|
| `layer_first` | `[2, layer, slot, head, dim]` | `[layer, slot, 1, dim]` |
| `page_first` | `[2, slot, layer, head, dim]` | `[slot, layer, 1, dim]` |
| `page_first_direct` | `[2, page, layer, token, head, dim]` | `[page, layer, token, 1, dim]` |
| `page_head` | `[2, page, head, token, layer, dim]` | (none) |

Every one is a kvring layout with a page as a block: per layer an offset,
and block, head and token strides, read here from the tensor's own strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvring
from kvring import KvringError

# Axis names of kv_buffer, per layout: "kv" (K / V), "layer", "slot" (token
# slot: pages are page_size slots), "page" and "token" (a page, a token in
# it), "head", "dim".
_MHA_AXES = {
    "layer_first": ("kv", "layer", "slot", "head", "dim"),
    "page_first": ("kv", "slot", "layer", "head", "dim"),
    "page_first_direct": ("kv", "page", "layer", "token", "head", "dim"),
    "page_head": ("kv", "page", "head", "token", "layer", "dim"),
}
_MLA_AXES = {
    "layer_first": ("layer", "slot", "head", "dim"),
    "page_first": ("slot", "layer", "head", "dim"),
    "page_first_direct": ("page", "layer", "token", "head", "dim"),
}


@dataclass(frozen=True)
class HostPoolView:
    """What kvring registers of a host pool, and how its pages are named."""

    layout: kvring.Layout
    address: int
    page_size: int
    pages: int
    model_id: int
    model_text: str
    world_size: int
    rank: int

    def page_of(self, host_indices: Any) -> list[int]:
        """The pages of `host_indices` (token slots, `page_size` a page,
        each page's slots consecutive from a multiple of `page_size`), as
        SGLang passes them to `batch_get_v1` / `batch_set_v1`."""
        slots = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
        p = self.page_size
        if len(slots) % p:
            raise KvringError(f"{len(slots)} host slots are not whole pages of {p}")
        pages = []
        for i in range(0, len(slots), p):
            first = int(slots[i])
            if first % p or int(slots[i + p - 1]) != first + p - 1 or not 0 <= first // p < self.pages:
                raise KvringError(f"host slots {first}..{int(slots[i + p - 1])} are not one page of the pool")
            pages.append(first // p)
        return pages


def describe_host_pool(pool: Any, storage_config: Any, model: str | None) -> HostPoolView:
    """The layout, address and identity of SGLang's host pool `pool`, for
    the rank `storage_config` (SGLang's `HiCacheStorageConfig`) says."""
    buf = pool.kv_buffer
    if getattr(buf, "device", None) is not None and str(buf.device) != "cpu":
        raise KvringError(f"the host pool lies on {buf.device}, not in host memory")
    layout_name = str(pool.layout)
    mla = bool(storage_config.is_mla_model)
    axes = (_MLA_AXES if mla else _MHA_AXES).get(layout_name)
    if axes is None:
        kind = "an MLA" if mla else "an MHA"
        raise KvringError(
            f"SGLang's host layout {layout_name!r} of {kind} model is not one kvring reads "
            f"(it reads {sorted(_MLA_AXES if mla else _MHA_AXES)}): set --hicache-mem-layout"
        )
    if len(buf.shape) != len(axes):
        raise KvringError(f"the host pool's buffer has shape {tuple(buf.shape)}, not the axes {axes}")
    if getattr(storage_config, "should_split_heads", False):
        raise KvringError("SGLang splits this pool's heads among ranks of another size; kvring does not")
    e = buf.element_size()
    dim = dict(zip(axes, buf.shape))
    stride = {a: s * e for a, s in zip(axes, buf.stride())}
    page = int(pool.page_size)
    if stride["dim"] != e:
        raise KvringError("the host pool's head dimension is not contiguous")
    layers, heads, width = dim["layer"], dim["head"], dim["dim"]
    if "slot" in axes:
        if dim["slot"] % page:
            raise KvringError(f"the host pool's {dim['slot']} slots are not whole pages of {page}")
        pages, token_stride, block_stride = dim["slot"] // page, stride["slot"], stride["slot"] * page
    else:
        if dim["token"] != page:
            raise KvringError(f"the host pool's pages hold {dim['token']} tokens, not page_size {page}")
        pages, token_stride, block_stride = dim["page"], stride["token"], stride["page"]
    placements = [
        (
            0,
            layer * stride["layer"],
            0 if mla else stride["kv"] + layer * stride["layer"],  # MLA has no V
            block_stride,
            stride["head"],
            token_stride,
        )
        for layer in range(layers)
    ]
    layout = kvring.Layout(
        layers=layers,
        blocks=pages,
        block_tokens=page,
        heads=heads,
        k_width=width,
        v_width=0 if mla else width,
        elem_bytes=e,
        allocations=[buf.numel() * e],
        placements=placements,
        shared=mla,
    )
    name = model if model is not None else storage_config.model_name
    if not name:
        raise KvringError("SGLang gave no model name: set kvring.model")
    # What SGLang's page keys lack (they hash token ids only): the model,
    # the KV's dtype and shape, and the pipeline / context-parallel part of
    # it this rank holds. Tensor-parallel ranks are kvring ranks (one object
    # each), MLA's latent is one object for every rank.
    device_dtype = getattr(getattr(pool, "device_pool", None), "dtype", None)
    parts = [
        "engine=sglang",
        f"model={name}",
        f"dtype={buf.dtype}" + (f"/{device_dtype}" if device_dtype is not None else ""),
        f"layers={layers}",
        f"heads={heads}",
        f"width={width}",
        "mla" if mla else "mha",
        f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
    ]
    cp_size = getattr(storage_config, "attn_cp_size", 1) or 1
    if cp_size > 1:
        parts.append(f"cp={storage_config.attn_cp_rank}/{cp_size}")
    text = "|".join(parts)
    world, rank = (1, 0) if mla else (int(storage_config.tp_size), int(storage_config.tp_rank))
    return HostPoolView(
        layout=layout,
        address=int(buf.data_ptr()),
        page_size=page,
        pages=pages,
        model_id=kvring.model_id(text),
        model_text=text,
        world_size=world,
        rank=rank,
    )
