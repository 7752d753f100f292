"""vLLM's KV cache groups, as kvring's connector caches them.

vLLM's hybrid KV cache manager gives each kind of attention layer its own
group: one block table per group, over one pool of blocks whose pages every
group's layers share (block `b` belongs to one group at a time; layer `j` of
each group views the same bytes). A sliding-window group keeps only the
blocks of its window: those before it are freed during the prefill and read
as the null block (id 0) in a request's block list.

kvring caches a chunk of a model of several groups as one object per group:
the group is part of the chunk's key (its salt), so the objects of two groups
never meet, and each is copied with that group's block ids. kvring registers
one set of layers, the "slots": the layers of the largest group, which every
other group's layer `j` aliases (checked at registration). A group with
fewer layers than there are slots copies the pages of its blocks in the
other slots too: those pages belong to no layer while the group owns the
block, so nothing reads what lands there.

What is stored and loaded, per kind of group:

- full attention: every chunk, and a hit loads every chunk;
- sliding window: every chunk too (a later, longer prompt's window can end
  at any chunk), and a hit loads only the blocks vLLM kept for the window
  before the first token to compute; a chunk whose first blocks vLLM freed
  before the step that completes it (a chunked prefill that moved past the
  window) is not stored for any group, since its window part cannot be;
- state (Mamba2, short convolutions, gated delta nets: vLLM's
  `MambaSpec`, with prefix caching on, in its "align" mode): a state exists
  only where a step ended on a block boundary, in the group's block of the
  token before it (block `t // block - 1` holds the state after `t`
  tokens). kvring stores it when a step ends on a chunk boundary: the
  object of chunk `i` of a state group is the group's blocks of chunk `i`,
  whose last holds the state after the chunk (the others, null or states
  vLLM keeps of its own, are never loaded). A hit ends where the attention
  groups' chunks and a state all are, and loads the state alone into the
  block vLLM gives the hit's last token;
- anything else (state without prefix caching, chunked local attention):
  not cached; the connector says why and stays out of the way.

Pure logic: this module imports neither torch nor vLLM's engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0
"""The block id vLLM gives every position a group does not hold (its block
pool's null block, created first)."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group as kvring caches it."""

    index: int
    layers: tuple[str, ...]
    window: int | None
    """A sliding-window group's window in tokens; None: full attention or state."""
    key: str
    """What the group adds to its chunks' salt: "" for the only group of a
    model (its keys are those of a model without groups), else its kind,
    window and layers."""
    state: bool = False
    """A state group (one state per chunk boundary, not KV per token)."""


def cache_groups(kv_cache_config: Any) -> tuple[list[CacheGroup], str | None]:
    """The groups of vLLM's `KVCacheConfig`, or the reason kvring cannot
    cache this model (then no groups). None (no config: vLLM before the
    hybrid manager, or a stand-in) is one full-attention group of every
    layer, named by the engine's tensors later."""
    if kv_cache_config is None:
        return [CacheGroup(0, (), None, "")], None
    specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not specs:
        return [], "vLLM's KV cache configuration has no KV cache groups"
    groups: list[CacheGroup] = []
    for i, g in enumerate(specs):
        kind, window = _kind(g.kv_cache_spec)
        layers = tuple(g.layer_names)
        if kind == "state" and (mode := _state_mode(g.kv_cache_spec)) != "align":
            return [], (
                f"KV cache group {i} holds {type(g.kv_cache_spec).__name__} state ({', '.join(layers[:3])}...): "
                "kvring caches a state only where vLLM keeps one per block boundary (prefix caching on: "
                f"mamba_cache_mode 'align', not {mode!r})"
            )
        if kind is None:
            return [], (
                f"KV cache group {i} holds {type(g.kv_cache_spec).__name__} layers "
                f"({', '.join(layers[:3])}...): kvring caches attention KV (full and "
                "sliding-window) and block-aligned state, not this"
            )
        key = "" if len(specs) == 1 else f"{kind}:{window}:{','.join(layers)}"
        groups.append(CacheGroup(i, layers, window, key, state=kind == "state"))
    if all(g.state for g in groups):
        return [], "every KV cache group holds state: kvring caches a state only beside attention KV"
    return groups, None


def _kind(spec: Any) -> tuple[str | None, int | None]:
    """("full", "sliding" or "state", window) of a group's spec; (None,
    None) for a kind kvring does not cache. By the names of the spec's classes (its own
    and its bases), so that every vLLM version's classes, their subclasses
    and the worker's uniform-type wrapper are understood."""
    names = {c.__name__ for c in type(spec).__mro__}
    if "UniformTypeKVCacheSpecs" in names:
        kinds = {_kind(s) for s in getattr(spec, "kv_cache_specs", {}).values()}
        return kinds.pop() if len(kinds) == 1 else (None, None)
    if "MambaSpec" in names:
        return "state", None
    if "SlidingWindowSpec" in names:
        return "sliding", int(spec.sliding_window)
    if "FullAttentionSpec" in names:
        # With the hybrid manager off, vLLM gives a sliding-window layer
        # every block of the prompt (a full-attention spec that carries its
        # window): cached as full attention.
        if getattr(spec, "attention_chunk_size", None):
            return None, None
        return "full", None
    return None, None


def _state_mode(spec: Any) -> str | None:
    """vLLM's `mamba_cache_mode` of a state group's spec (of the specs a
    uniform-type wrapper holds)."""
    inner = list(getattr(spec, "kv_cache_specs", {}).values())
    return getattr(inner[0] if inner else spec, "mamba_cache_mode", None)


def slot_layers(groups: Sequence[CacheGroup], names: Sequence[str]) -> list[str]:
    """The layers kvring registers: for one group every layer the engine
    gave (`names`, its order), else the largest attention group's, in
    vLLM's order (a state group's layers view the same pages as state)."""
    if len(groups) == 1:
        return list(names)
    largest = max((g for g in groups if not g.state), key=lambda g: (len(g.layers), -g.index))
    return list(largest.layers)


def aliasing_error(groups: Sequence[CacheGroup], slots: Sequence[str], views: dict[str, tuple]) -> str | None:
    """Why the groups' layers are not views of the slots (None: they are).
    `views` maps a layer name to what identifies its view (address, shape,
    strides, dtype, element bytes): layer `j` of every attention group must
    view what slot `j` does, as vLLM lays out the groups' shared pages; a
    state group's layer `j` must start where slot `j` does, with blocks of
    the same stride (its state is a part of each page)."""
    if len(groups) == 1:
        return None
    for g in groups:
        for j, name in enumerate(g.layers):
            slot = views.get(slots[j]) if j < len(slots) else None
            view = views.get(name)
            same = view is not None and slot is not None and (_state_aliases(view, slot) if g.state else view == slot)
            if not same:
                return (
                    f"layer {name} (KV cache group {g.index}) is not a view of the memory of "
                    f"{slots[j] if j < len(slots) else 'any slot'}: kvring expects the groups' layers "
                    "to share pages as vLLM's hybrid manager lays them out"
                )
    return None


def _state_aliases(view: tuple, slot: tuple) -> bool:
    """Whether a state layer's view (address, shape, strides, dtype, element
    bytes; its first dimension the blocks) starts at the slot's address and
    steps from block to block as one of the slot's dimensions does."""
    address, shape, strides, _, elem = view
    s_address, s_shape, s_strides, _, s_elem = slot
    if address != s_address or not shape:
        return False
    return any(n == shape[0] and st * s_elem == strides[0] * elem for n, st in zip(s_shape, s_strides, strict=True))


def state_to_store(
    block_ids: Sequence[int], computed: int, prompt_chunks: int, block: int, chunk: int
) -> int | None:
    """The chunk whose state a step that ends at `computed` tokens leaves in
    a state group whose block list is `block_ids`: chunk `computed // chunk
    - 1`, its state in the block of the token before `computed`. None where
    the step does not end on a chunk boundary of the prompt, or the group
    holds no block there."""
    if computed <= 0 or computed % chunk or computed // chunk > prompt_chunks:
        return None
    at = computed // block - 1
    if at >= len(block_ids) or block_ids[at] == NULL_BLOCK:
        return None
    return computed // chunk - 1


def state_candidates(attention_hit: int, max_chunks: int, n: int) -> list[int]:
    """The chunks whose state a lookup asks for, the latest first: a hit
    ends after one of them, within the chunks the attention groups hold
    (`attention_hit`) and the request may load (`max_chunks`). States exist
    where steps ended (the end of an earlier prompt's prefill, a chunked
    prefill's steps), so the last `n` chunks are asked."""
    top = min(attention_hit, max_chunks)
    return list(range(top - 1, max(top - n, 0) - 1, -1))


def storable_chunks(group: CacheGroup, first: int, end: int, computed_before: int, block: int, chunk: int) -> int:
    """How many of chunks `first..end-1`, completed by a step that started at
    `computed_before` tokens, can be stored in this group: all of them while
    it still holds the first block of chunk `first` (what it frees is a
    prefix of its blocks), else none. A sliding-window group has freed the
    blocks wholly before the window of `computed_before` tokens (vLLM frees
    on fewer, the tokens already processed, so never more); full attention
    frees nothing."""
    if end <= first:
        return 0
    if group.window is None:
        return end - first
    freed_blocks = max(0, computed_before - group.window + 1) // block
    return end - first if first * chunk // block >= freed_blocks else 0


def load_span(block_ids: Sequence[int], start: int, end: int, block: int, chunk: int) -> tuple[int, int, list[int]] | None:
    """(first chunk, tokens to skip in it, its block ids) to load tokens
    `start..end` into a group whose block list is `block_ids`: from the
    first block the group holds (a sliding-window group's earlier positions
    are the null block). None: no block to load, or a null block after a
    held one (a layout this connector does not know: the load fails)."""
    first_block = start // block
    last_block = -(-end // block)
    held = [i for i in range(first_block, last_block) if block_ids[i] != NULL_BLOCK]
    if not held:
        return None
    if held != list(range(held[0], last_block)):
        return None
    begin = max(start, held[0] * block)
    first_chunk = begin // chunk
    per_chunk = chunk // block
    ids = list(block_ids[first_chunk * per_chunk : -(-end // chunk) * per_chunk])
    return first_chunk, begin - first_chunk * chunk, ids
