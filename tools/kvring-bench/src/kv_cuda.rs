//! The KV data path on the CUDA backend, in one run (Llama-3-8B geometry:
//! 32 layers, 8 KV heads, head dim 128, 2-byte elements, 16-token blocks,
//! 256-token chunks unless `--chunk-tokens` says otherwise; 1024 random
//! blocks = 16,384 tokens = 2 GiB per job), the
//! engine's cache laid out as `--layout` (default `lbnhc`, vLLM's default;
//! `mla` is measured with DeepSeek-V3's latent geometry). Each figure is a
//! median over the passes (the ceilings: over `max(passes, 3)` copies),
//! with its p99 (the slow tail):
//!
//! * `store_gbps` / `retrieve_gbps`: a STORE (RETRIEVE) job of the 1024
//!   blocks from (into) an engine's GPU cache, submit to done; every
//!   retrieved byte is checked;
//! * `pinned_memcpy_gbps`: one 2 GiB cuMemcpy device -> pinned host and back
//!   (the PCIe ceiling);
//! * `bidirectional_memcpy_gbps`: a 2 GiB D2H and a 2 GiB H2D at the same
//!   moment on two streams: each direction, their sum, and the total (4 GiB
//!   over the time until both are done);
//! * `concurrent_store_retrieve_gbps`: one engine's STORE of 2 GiB while
//!   another engine on the same GPU (its own client and cache) RETRIEVEs
//!   2 GiB of other chunks, set against the bidirectional ceiling;
//! * `per_block_memcpy_gbps`: one cuMemcpyAsync per 32 KiB layer/K|V/block
//!   piece into pinned memory, what vLLM's swap_blocks and a naive server do;
//! * `cross_layer_block_memcpy_gbps`: one cuMemcpyAsync per 2 MiB block of
//!   all layers (contiguous, as in a block-outermost layout), each way:
//!   vLLM's native CPU offloading.
//!
//! With several GPUs (`--devices`, default all), each GPU holds one rank of
//! a tensor-parallel engine (its own client, like a worker process): the
//! ranks store at the same moment, the scheduler looks the prompt up once,
//! and the ranks retrieve with that lease at the same moment. Reported per
//! GPU and in aggregate (all ranks' bytes over the slowest rank's time),
//! against the pinned-memcpy ceiling measured on every GPU at once.
//!
//! Needs the `cuda` feature (on by default).

#[cfg(feature = "cuda")]
mod gpu;

#[cfg(feature = "cuda")]
pub use gpu::run;

/// Without CUDA support there is nothing to measure.
#[cfg(not(feature = "cuda"))]
pub fn run(
    _json_out: bool,
    _passes: usize,
    _copy_threads: Option<u32>,
    _devices: Option<usize>,
    _layout: kvring::kv::LayoutPreset,
    _chunk_tokens: u32,
) {
    eprintln!("kvring-bench was built without the `cuda` feature");
    std::process::exit(1);
}
