"""What the running vLLM offers, found by feature tests rather than by
version numbers (the connector follows vLLM 0.26 to 0.34)."""

from __future__ import annotations

try:  # vLLM 0.32 and later: a failed load reported per request.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None

REPORTS_FAILED_LOADS = KVConnectorTransferResults is not None and "failed_recving" in getattr(
    KVConnectorTransferResults, "__dataclass_fields__", {}
)
"""Whether vLLM takes a failed load as a failed request (needed for a
model of several KV cache groups, whose failures vLLM cannot take per
block)."""

try:  # vLLM 0.32 and later attribute external hits to a cache tier.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None
