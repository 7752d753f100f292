"""Models for bench_sglang_gpu.py, loaded by SGLang itself through
`SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_models` (each module's `EntryClass`
replaces SGLang's class of that name)."""
