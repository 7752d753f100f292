"""This is a stand-in for the part of vLLM's interface that kvring's
connector (`kvring/vllm/`) uses, installed only where vLLM cannot be
imported; the connector's conformance to real vLLM is tested against real
vLLM in python/tests/vllm.

The GPU test machine has torch but no vLLM, so the connector's `from vllm...`
imports cannot be satisfied there. `install()` then registers, in
`sys.modules`, the few vLLM modules and names the connector imports (at
import time and inside its functions), shaped as in vLLM 0.33/0.34:

- `vllm.distributed.kv_transfer.kv_connector.v1.base`: `KVConnectorBase_V1`
  (the constructor, metadata binding and abstract methods of 0.34),
  `KVConnectorMetadata`, `KVConnectorRole`, `SupportsHMA`,
  `KVConnectorTransferResults`;
- `vllm.distributed.kv_transfer.kv_connector.v1.metrics`: `KVConnectorStats`;
- `vllm.distributed.parallel_state`: `get_pp_group`,
  `get_tensor_model_parallel_rank`;
- `vllm.platforms`: `current_platform`;
- `vllm.config.kv_transfer`: `KVCacheAccess` (0.34);
- `vllm.v1.metrics.cache_hit_source`: `CacheHitSource` (0.32 and later).

Every other `vllm` module is refused (ImportError), as where vLLM is absent.
The stand-in only lets the mini-engine harness run the real connector on a
machine without vLLM. Where vLLM is importable, `install()` leaves it alone,
and only `set_parallel_rank` patches the real `vllm.distributed.parallel_state`
(the harness has no distributed groups).

Setting `KVRING_ENGINE_STANDIN=1` installs the stand-in even where vLLM is
importable (a meta path finder hides the real package), which is how the
CPU run checks the path the GPU machine takes.
"""

from __future__ import annotations

import enum
import importlib.abc
import os
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

FORCE_ENV = "KVRING_ENGINE_STANDIN"
"""Set to 1: use the stand-in even where vLLM is importable."""


def install(device_type: str) -> bool:
    """Makes `import vllm...` work for the connector, on a `device_type`
    ("cuda" or "cpu") platform. Returns True when the stand-in is in use,
    False when real vLLM is. Call it before anything imports vllm."""
    standin = sys.modules.get("vllm")
    if standin is not None and getattr(standin, "__kvring_standin__", False):
        _PLATFORM.device_type = device_type
        return True
    if os.environ.get(FORCE_ENV) != "1":
        try:
            import vllm  # noqa: F401
        except ImportError:
            pass
        else:
            return False
    elif "vllm" in sys.modules:
        raise RuntimeError(f"{FORCE_ENV}=1, but the real vllm was imported before the stand-in")
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]  # what a failed import of vllm left behind
    _PLATFORM.device_type = device_type
    sys.meta_path.insert(0, _RefuseVllm())
    for name, module in _modules().items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True


def set_parallel_rank(tp_rank: int) -> None:
    """This process is tensor-parallel rank `tp_rank` of pipeline stage 0:
    what `get_tensor_model_parallel_rank()` and `get_pp_group().rank_in_group`
    answer, in the stand-in or (patched) in real vLLM."""
    from vllm.distributed import parallel_state

    group = _GroupCoordinator(rank_in_group=0, world_size=1)
    parallel_state.get_pp_group = lambda: group
    parallel_state.get_tensor_model_parallel_rank = lambda: tp_rank


class _RefuseVllm(importlib.abc.MetaPathFinder):
    """Refuses every `vllm` module not registered by the stand-in, so that
    the real package (if any) is never mixed in."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (vLLM stand-in)", name=fullname)
        return None


# ---------------------------------------------------------------- base.py


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    """Abstract metadata of one step, from the scheduler to the workers."""


class KVConnectorBase_V1(ABC):  # noqa: N801
    """vLLM 0.34's base class: its constructor, role and metadata binding,
    and the methods it declares abstract."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...


# ---------------------------------------------------------------- metrics.py


@dataclass
class KVConnectorStats:
    """Counters a connector hands vLLM each step; subclasses aggregate them."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        raise NotImplementedError

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        raise NotImplementedError

    def reduce(self) -> dict[str, int | float]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError


class SupportsHMA(ABC):
    """A connector that serves the hybrid KV cache manager: vLLM calls its
    `request_finished_all_groups` instead of `request_finished`."""

    @abstractmethod
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        raise NotImplementedError


@dataclass
class KVConnectorTransferResults:
    """vLLM 0.32+: a worker's finished transfers and failed receives."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


# ---------------------------------------------------------------- the rest


class KVCacheAccess(enum.IntFlag):
    """vLLM 0.34: how a connector reaches the device KV cache."""

    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()

    def needs_single_chunk(self) -> bool:
        exports = KVCacheAccess.EXPORTS_FD | KVCacheAccess.EXPORTS_FABRIC
        return bool(self & (KVCacheAccess.REGISTERS | exports))


class CacheHitSource(str, enum.Enum):
    """vLLM 0.32+: the tier cached prompt tokens came from."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


@dataclass
class _GroupCoordinator:
    rank_in_group: int
    world_size: int


class _Platform:
    """`vllm.platforms.current_platform`: the device type and its tests."""

    device_type = "cpu"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


_PLATFORM = _Platform()


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name, "vLLM stand-in (python/tests/engine/standin_vllm.py)")
    m.__dict__.update(attrs)
    return m


def _modules() -> dict[str, types.ModuleType]:
    """The stand-in modules, parents before children."""
    v1 = "vllm.distributed.kv_transfer.kv_connector.v1"
    pp_group = _GroupCoordinator(rank_in_group=0, world_size=1)
    return {
        "vllm": _module("vllm", __kvring_standin__=True),
        "vllm.config": _module("vllm.config"),
        "vllm.config.kv_transfer": _module("vllm.config.kv_transfer", KVCacheAccess=KVCacheAccess),
        "vllm.platforms": _module("vllm.platforms", current_platform=_PLATFORM),
        "vllm.distributed": _module("vllm.distributed"),
        "vllm.distributed.parallel_state": _module(
            "vllm.distributed.parallel_state",
            get_pp_group=lambda: pp_group,
            get_tensor_model_parallel_rank=lambda: 0,
        ),
        "vllm.distributed.kv_transfer": _module("vllm.distributed.kv_transfer"),
        "vllm.distributed.kv_transfer.kv_connector": _module("vllm.distributed.kv_transfer.kv_connector"),
        v1: _module(v1),
        f"{v1}.base": _module(
            f"{v1}.base",
            KVConnectorBase_V1=KVConnectorBase_V1,
            KVConnectorMetadata=KVConnectorMetadata,
            KVConnectorRole=KVConnectorRole,
            SupportsHMA=SupportsHMA,
            KVConnectorTransferResults=KVConnectorTransferResults,
        ),
        f"{v1}.metrics": _module(f"{v1}.metrics", KVConnectorStats=KVConnectorStats),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.metrics": _module("vllm.v1.metrics"),
        "vllm.v1.metrics.cache_hit_source": _module("vllm.v1.metrics.cache_hit_source", CacheHitSource=CacheHitSource),
    }
