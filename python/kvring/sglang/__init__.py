"""kvring as SGLang's HiCache storage backend: one node cache for SGLang and
vLLM engines alike.

Load it with SGLang's `dynamic` backend (in the scheduler processes; this
package must be importable there)::

    --enable-hierarchical-cache --page-size 256 \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvring",
        "module_path": "kvring.sglang", "class_name": "KvringStorage",
        "interface_v1": 1}'

A page is a kvring object, so SGLang's page size must be the server's
chunk size (256 tokens by default; a server this backend starts takes the
page size). `kvring.*` keys in the same JSON tune it (`settings`), and
docs/sglang.md says what it does.

The package: `settings` (the keys), `host_pool` (SGLang's host pool as a
kvring layout, and the identity of its pages), `storage` (the backend).
"""

from kvring.sglang.storage import KvringStorage, page_key

__all__ = ["KvringStorage", "page_key"]
