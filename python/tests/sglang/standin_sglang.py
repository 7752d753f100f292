"""SGLang where it is not installed: the one module the storage backend
imports (`sglang.srt.mem_cache.hicache_storage`), as SGLang 0.5.16 declares
it: the `HiCacheStorage` base class, its abstract methods and defaults, and
the dataclasses SGLang passes in. Where SGLang is importable (the GPU
machine's bundle) the real one is used unless KVRING_SGLANG_STANDIN=1."""

from __future__ import annotations

import abc
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class HiCacheStorage(abc.ABC):
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        pass

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        pass

    @abc.abstractmethod
    def get(self, key, target_location=None, target_sizes=None): ...

    @abc.abstractmethod
    def batch_get(self, keys, target_locations=None, target_sizes=None): ...

    @abc.abstractmethod
    def set(self, key, value=None, target_location=None, target_sizes=None): ...

    @abc.abstractmethod
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...

    @abc.abstractmethod
    def exists(self, key) -> bool: ...

    def batch_exists(self, keys, extra_info=None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None


def install() -> str:
    """Puts the stand-in in place unless the real SGLang is used; says which."""
    forced = os.environ.get("KVRING_SGLANG_STANDIN") == "1"
    if not forced and importlib.util.find_spec("sglang") is not None:
        return "the real SGLang"
    mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    for name in ("HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo"):
        setattr(mod, name, globals()[name])
    parts = ["sglang", "sglang.srt", "sglang.srt.mem_cache"]
    for i, name in enumerate(parts):
        pkg = sys.modules.setdefault(name, types.ModuleType(name))
        pkg.__path__ = []
        if i:
            setattr(sys.modules[parts[i - 1]], name.rsplit(".", 1)[1], pkg)
    sys.modules[mod.__name__] = mod
    sys.modules["sglang.srt.mem_cache"].hicache_storage = mod
    return "the stand-in"
