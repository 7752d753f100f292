"""Who an engine's KV belongs to: the model id that engines sharing stored
chunks must agree on, the ranks that hold a shard of each chunk, and the
salt of a request's chunks."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

import kvring
from kvring import KvringError
from kvring.vllm_cache_groups import CacheGroup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


def engine_model_id(vllm_config: VllmConfig) -> tuple[int, str]:
    """The kvring model id of this engine's KV, and the text it hashes.

    Engines share stored chunks only when their KV bytes are interchangeable:
    same weights, KV dtype, per-rank heads, and the same object bytes. On a
    GPU an object holds each token's K and V rows whatever the engine's
    block size (`shm_layout.md`), so engines of different block sizes share
    objects. On a CPU a block is copied whole, as the attention kernel lays
    it out: the ISA vLLM picks decides its interior (K is stored transposed
    by the "vec" kernel, AMX packs differently) and so does the block size,
    so both are part of the id there.

    Computed from `vllm_config` alone, so the scheduler and every worker
    (separate processes) get the same id.
    """
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    parts = [
        "vllm-kv/2",
        f"model={mc.model}",
        f"revision={mc.revision}",
        f"quantization={mc.quantization}",
        f"kv_dtype={kv_dtype}",
        f"kv_heads={mc.get_num_kv_heads(pc)}",
        f"head_size={mc.get_head_size()}",
        f"mla={mc.use_mla}",
        f"platform={_platform_tag(vllm_config)}",
    ]
    if current_platform.is_cpu():
        parts.append(f"block={cc.block_size}")
    text = "|".join(parts)
    return kvring.model_id(text), text


def _platform_tag(vllm_config: VllmConfig) -> str:
    """The device type, plus on CPU the attention ISA that lays out blocks."""
    from vllm.platforms import current_platform

    tag = current_platform.device_type
    if current_platform.is_cpu():
        tag += f"/isa={_cpu_attention_isa(vllm_config)}"
    return tag


def _cpu_attention_isa(vllm_config: VllmConfig) -> str:
    """The ISA vLLM's CPU attention backend picks for this engine.

    The backend's chooser is private and its parameters changed across
    versions, so it is called with the parameters it declares; without it
    the CPU capability torch dispatches to stands in (coarser, still
    separating AVX-512 from AVX2 hosts).
    """
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        cpu_attn = None
    choose = getattr(cpu_attn, "_get_attn_isa", None)
    if choose is None:
        return f"torch-{torch.backends.cpu.get_cpu_capability()}"
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    args = {
        "dtype": mc.dtype,
        "block_size": cc.block_size,
        "head_size": mc.get_head_size(),
        "kv_cache_dtype": cc.cache_dtype,
    }
    params = inspect.signature(choose).parameters
    return str(choose(**{k: v for k, v in args.items() if k in params}))


def world_size(vllm_config: VllmConfig) -> int:
    """Ranks that each hold a shard of every chunk: tensor x pipeline
    parallel (a LOOKUP hits only where every one of them stored it)."""
    pc = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, attr, 1) > 1:
            raise KvringError(f"kvring does not support {attr} > 1 (KV sharded by token)")
    return pc.tensor_parallel_size * pc.pipeline_parallel_size


def request_salt(request: Request, group: CacheGroup) -> int:
    """The kvring salt of a request's chunks in one KV cache group: its cache
    salt and LoRA adapter, both of which change the KV of the same tokens,
    and the group (`CacheGroup.key`; none for a model of one group)."""
    parts = []
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_path', None) or lora.lora_name}")
    if group.key:
        parts.append(f"cache_group={group.key}")
    return kvring.salt_id("|".join(parts) if parts else None)
