"""How the vLLM connector reads vLLM's KV cache groups: which it caches, the
layers it registers, which chunks a sliding-window group can store and
which blocks a hit loads (pure logic: vLLM's classes are stood in for by
name, as the module reads them)."""

from types import SimpleNamespace

import pytest

from kvring.vllm_cache_groups import (
    NULL_BLOCK,
    aliasing_error,
    cache_groups,
    load_span,
    slot_layers,
    state_candidates,
    state_to_store,
    storable_chunks,
)


def spec(kind, **fields):
    return type(kind, (), fields)()


def config(*groups):
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=names) for s, names in groups]
    )


FULL = spec("FullAttentionSpec", sliding_window=None, attention_chunk_size=None)
SLIDING = spec("SlidingWindowSpec", sliding_window=64)
STATE = spec("MambaSpec", mamba_cache_mode="align")


def test_a_subclass_of_a_known_spec_is_its_kind():
    mla = type("MLAAttentionSpec", (type(FULL),), {})()
    groups, why = cache_groups(config((mla, ["l0"]), (SLIDING, ["l1"])))
    assert why is None and [g.window for g in groups] == [None, 64]


def test_a_model_of_one_group_keeps_the_keys_of_a_model_without_groups():
    groups, why = cache_groups(config((FULL, ["l0", "l1"])))
    assert why is None and [g.key for g in groups] == [""]
    groups, why = cache_groups(None)
    assert why is None and len(groups) == 1 and groups[0].key == ""


def test_each_group_of_a_hybrid_model_has_keys_of_its_own():
    groups, why = cache_groups(config((SLIDING, ["l0", "l2"]), (FULL, ["l1", "l3"])))
    assert why is None
    assert [(g.index, g.window) for g in groups] == [(0, 64), (1, None)]
    assert groups[0].key != groups[1].key and all(g.key for g in groups)
    # The same kinds over other layers are other groups.
    other, _ = cache_groups(config((SLIDING, ["l0", "l3"]), (FULL, ["l1", "l2"])))
    assert {g.key for g in other}.isdisjoint(g.key for g in groups)


@pytest.mark.parametrize(
    "bad",
    [
        spec("MambaSpec", shapes=((3, 8),)),
        spec("MambaSpec", mamba_cache_mode="none"),
        spec("ChunkedLocalAttentionSpec", attention_chunk_size=512),
        spec("FullAttentionSpec", sliding_window=None, attention_chunk_size=512),
    ],
)
def test_state_and_chunked_local_groups_are_refused_with_the_reason(bad):
    groups, why = cache_groups(config((FULL, ["l1"]), (bad, ["l0"])))
    assert groups == [] and "group 1" in why and type(bad).__name__ in why


def test_block_aligned_state_is_a_group_of_its_own_beside_attention_only():
    groups, why = cache_groups(config((STATE, ["m0", "m1", "m2"]), (FULL, ["f0"])))
    assert why is None and [g.state for g in groups] == [True, False]
    assert groups[0].key.startswith("state:") and groups[0].key != groups[1].key
    groups, why = cache_groups(config((STATE, ["m0"])))
    assert groups == [] and "every KV cache group holds state" in why


def test_the_slots_are_an_attention_groups_and_a_state_layer_starts_where_its_slot_does():
    groups, _ = cache_groups(config((STATE, ["m0", "m1", "m2"]), (FULL, ["f0", "f1"])))
    slots = slot_layers(groups, ["m0", "f0", "m1", "f1", "m2"])
    assert slots == ["f0", "f1"]
    # A state view (blocks first, 2 KiB of state at the start of each 128
    # KiB page) of the memory of an attention view (float32, blocks first,
    # K and V in each page's halves), as vLLM's CPU runner hands them over.
    att = lambda at: (at, (100, 2, 128, 128), (32768, 16384, 128, 1), "float32", 4)  # noqa: E731
    st = lambda at, step=131072: (at, (100, 1, 1, 2048), (step, 2048, 2048, 1), "int8", 1)  # noqa: E731
    views = {"f0": att(0x1000), "f1": att(0x9000), "m0": st(0x1000), "m1": st(0x9000)}
    groups, _ = cache_groups(config((STATE, ["m0", "m1"]), (FULL, ["f0", "f1"])))
    assert aliasing_error(groups, slots, views) is None
    assert "m1" in aliasing_error(groups, slots, {**views, "m1": st(0x9008)})
    assert "m1" in aliasing_error(groups, slots, {**views, "m1": st(0x9000, step=65536)})
    groups, _ = cache_groups(config((STATE, ["m0", "m1", "m2"]), (FULL, ["f0", "f1"])))
    assert "m2" in aliasing_error(groups, slots, views)


def test_a_state_is_stored_where_a_step_ends_on_a_chunk_boundary_of_the_prompt():
    # Blocks of 128 tokens, chunks of 256; the group holds block 7 (the
    # state after 1,024 tokens) and the running state in block 19.
    ids = [NULL_BLOCK] * 7 + [11, 19]
    assert state_to_store(ids, 1024, 8, 128, 256) == 3
    assert state_to_store(ids, 1024, 3, 128, 256) is None  # past the prompt's chunks
    assert state_to_store(ids, 896, 8, 128, 256) is None  # not a chunk boundary
    assert state_to_store(ids, 768, 8, 128, 256) is None  # no state there
    assert state_to_store(ids, 0, 8, 128, 256) is None


def test_a_lookup_asks_for_the_states_of_the_latest_chunks_a_hit_may_end_after():
    assert state_candidates(10, 20, 4) == [9, 8, 7, 6]
    assert state_candidates(10, 5, 4) == [4, 3, 2, 1]
    assert state_candidates(2, 20, 4) == [1, 0]
    assert state_candidates(0, 20, 4) == []


def test_the_slots_are_the_largest_groups_layers_and_every_group_must_view_them():
    groups, _ = cache_groups(config((SLIDING, ["s0", "s1", "s2"]), (FULL, ["f0", "f1"])))
    slots = slot_layers(groups, ["s0", "f0", "s1", "f1", "s2"])
    assert slots == ["s0", "s1", "s2"]
    views = {"s0": (1,), "s1": (2,), "s2": (3,), "f0": (1,), "f1": (2,)}
    assert aliasing_error(groups, slots, views) is None
    views["f1"] = (9,)
    assert "f1" in aliasing_error(groups, slots, views)


def test_a_chunk_is_stored_in_a_window_group_only_while_it_holds_the_first_block():
    (g,) = [x for x in cache_groups(config((SLIDING, ["l0"]), (FULL, ["l1"])))[0] if x.window]
    full = cache_groups(config((SLIDING, ["l0"]), (FULL, ["l1"])))[0][1]
    # 256-token chunks of 128-token blocks, a 64-token window: the step that
    # completes chunk 0 starting at 128 tokens still holds block 0 ...
    assert storable_chunks(g, 0, 1, 128, 128, 256) == 1
    # ... one starting at 192 does not (tokens 129..192 are the window).
    assert storable_chunks(g, 0, 1, 192, 128, 256) == 0
    # A one-step prefill of four chunks stores all of them.
    assert storable_chunks(g, 0, 4, 0, 128, 256) == 4
    assert storable_chunks(full, 0, 4, 10_000, 128, 256) == 4


def test_a_hit_loads_a_window_group_from_the_first_block_it_holds():
    # 512 tokens to load, 128-token blocks, 256-token chunks; vLLM holds only
    # the window's block (position 3) and the next one to compute.
    assert load_span([NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 7, 9], 0, 512, 128, 256) == (1, 128, [NULL_BLOCK, 7])
    assert load_span([1, 2, 3, 4, 5], 0, 512, 128, 256) == (0, 0, [1, 2, 3, 4])
    # After a local prefix hit of 128 tokens.
    assert load_span([1, 2, 3, 4], 128, 512, 128, 256) == (0, 128, [1, 2, 3, 4])
    # Nothing held, or a hole after a held block: not loaded.
    assert load_span([NULL_BLOCK] * 4, 0, 512, 128, 256) is None
    assert load_span([1, NULL_BLOCK, 3, 4], 0, 512, 128, 256) is None
