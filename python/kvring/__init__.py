"""kvring: a node-local KV-cache runtime for LLM inference.

Engines talk to one cache server per host through shared-memory rings; KV
blocks move between the engines' paged caches and the server's pool by the
server's own copies. This package is the client library (`Client`, with
`Job`, `Lease` and `Registration` handles that release what they hold),
the `kvring` command line (`python -m kvring serve`), and a vLLM connector
(`kvring.vllm.KvringConnector`).

Importing it loads no torch and no vLLM.
"""

from ._native import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_JOB_TIMEOUT,
    LAYOUT_PRESETS,
    Client,
    ClientClosed,
    CopiesInFlight,
    InvalidArgument,
    Job,
    JobStatus,
    KvringError,
    Layout,
    Lease,
    NoServer,
    PendingLookup,
    ProtocolError,
    Registration,
    RegistrationRefused,
    ServerGone,
    ServerTimeout,
    StatusError,
    __version__,
    chunk_hashes,
    model_id,
    prompt_hashes,
    salt_id,
)

try:  # built with the CUDA data plane (the published wheel is)
    from ._native import EngineStream
except ImportError:  # a wheel built without CUDA
    _has_cuda = False
else:
    _has_cuda = True

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_JOB_TIMEOUT",
    "LAYOUT_PRESETS",
    "Client",
    "ClientClosed",
    "CopiesInFlight",
    "InvalidArgument",
    "Job",
    "JobStatus",
    "KvringError",
    "Layout",
    "Lease",
    "NoServer",
    "PendingLookup",
    "ProtocolError",
    "Registration",
    "RegistrationRefused",
    "ServerGone",
    "ServerTimeout",
    "StatusError",
    "__version__",
    "chunk_hashes",
    "model_id",
    "prompt_hashes",
    "salt_id",
]
if _has_cuda:
    __all__.append("EngineStream")
