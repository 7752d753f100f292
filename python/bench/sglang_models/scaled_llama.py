"""SGLang's LlamaForCausalLM with informative dummy weights: after SGLang's
dummy loader (every parameter U(+-1e-3), norm gains included, so outputs
hardly depend on the context), the weights are redrawn as the vLLM
benchmark draws them (`bench_vllm_gpu.scale_weights`: std 0.02, norm gains
1), so outputs depend on the KV and a wrong one shows."""

from __future__ import annotations

from sglang.srt.models.llama import LlamaForCausalLM as _Llama

from bench_vllm_gpu import scale_weights


class LlamaForCausalLM(_Llama):
    def post_load_weights(self, *args, **kwargs):
        base = getattr(super(), "post_load_weights", None)
        if base is not None:
            base(*args, **kwargs)
        print(f"SCALED_WEIGHTS {scale_weights(self)}", flush=True)


EntryClass = LlamaForCausalLM
