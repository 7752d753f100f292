"""The connector's counters, reported through vLLM's KV connector stats."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_STAT_KEYS = (
    "lookups",
    "lookups_given_up",
    "lookup_hit_tokens",
    "load_chunks",
    "load_failures",
    "load_wait_us",
    "load_layer_waits",
    "store_chunks",
    "store_failures",
)


@dataclass
class KvringStats(KVConnectorStats):
    """Counters of one logging interval: lookups and lookup hit tokens (those
    vLLM loads) from the scheduler; loads and stores in chunks from the
    workers, summed over them (every rank counts its own shard), and the
    time workers' hooks waited for loads of the step's forward
    (`load_wait_us`: on a GPU, what was left of the copies once the forward
    was queued), and the layer-group waits the forward made
    (`load_layer_waits`)."""

    def __post_init__(self) -> None:
        for key in _STAT_KEYS:
            self.data.setdefault(key, 0)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KvringStats | None:
        """This interval's counters (None if nothing happened); starts the next."""
        if self.is_empty():
            return None
        taken = KvringStats(data=dict(self.data))
        self.reset()
        return taken
