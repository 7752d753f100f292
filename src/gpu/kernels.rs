//! The KV copy kernels (`kernels/kv_copy.cu`), compiled by NVRTC for the
//! device's architecture at first use and cached on disk, so later server
//! starts only load the PTX.

use super::{Context, CudaError, Function, GpuError, LaunchConfig, Module, Stream};
use std::ffi::c_void;
use std::path::PathBuf;

/// The kernels' source, embedded in the binary.
pub const KV_COPY_SRC: &str = include_str!("../../kernels/kv_copy.cu");

/// `KvCopyArgs` of the kernel, passed by value: the chunk and its copy
/// plan ([`crate::kv::CopyPlan`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCopyArgs {
    pub num_layers: u32,
    pub blocks_per_chunk: u32,
    pub skip_blocks: u32,
    pub to_engine: u32,
    pub block_tokens: u32,
    pub heads: u32,
    pub run_tokens: u32,
    pub run_heads: u32,
    pub parts: u32,
    /// Bytes per word: 16, 8, 4, 2 or 1.
    pub vec: u32,
    pub chunk_tokens: u32,
    pub _pad: u32,
    pub row_bytes: u64,
    pub width: [u64; 2],
    pub row_offset: [u64; 2],
    /// Device addresses of the job's `entered[worker]` and `cancel` words
    /// ([`crate::job_words`]) and of a device word for the gate's verdict
    /// (0: no job words): [`Kernels::gate`] stores `seq` into the first,
    /// reads the second and leaves in `verdict` whether it has reached
    /// `generation`; the copy's CTAs copy nothing if it has.
    pub entered: u64,
    pub cancel: u64,
    pub verdict: u64,
    pub seq: u32,
    pub generation: u32,
}

impl KvCopyArgs {
    /// The arguments for `blocks_per_chunk` blocks of a layout whose plan is
    /// `plan` and an object of `chunk_tokens` tokens a layer (the server's
    /// chunk: more than the blocks hold for a prompt's tail, whose blocks
    /// are the object's first rows), moving words of `vec` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: &crate::kv::CopyPlan,
        num_layers: u32,
        blocks_per_chunk: u32,
        chunk_tokens: u32,
        skip_blocks: u32,
        to_engine: bool,
        vec: u32,
    ) -> KvCopyArgs {
        debug_assert!(blocks_per_chunk * plan.block_tokens <= chunk_tokens);
        KvCopyArgs {
            num_layers,
            blocks_per_chunk,
            skip_blocks,
            to_engine: u32::from(to_engine),
            block_tokens: plan.block_tokens,
            heads: plan.all_heads,
            run_tokens: plan.tokens,
            run_heads: plan.heads,
            parts: plan.parts,
            vec,
            chunk_tokens,
            _pad: 0,
            row_bytes: plan.row_bytes,
            width: plan.width,
            row_offset: plan.row_offset,
            entered: 0,
            cancel: 0,
            verdict: 0,
            seq: 0,
            generation: 0,
        }
    }
}

/// One layer of a registration as the kernel reads it (`LayerEntry`): the
/// device addresses of its K and V rows of block 0 (V: 0 when they are one
/// run), and its strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LayerEntry {
    pub base: [u64; 2],
    pub block_stride: u64,
    pub head_stride: u64,
    pub token_stride: u64,
}

/// A loaded module and its `kv_copy` and `kv_gate` functions, in one
/// context.
pub struct Kernels {
    module: Module,
    kv_copy: Function,
    kv_gate: Function,
    /// Where the PTX came from ("compiled in N ms" or "cached at PATH").
    pub origin: String,
}

/// Where compiled PTX is kept: `$KVRING_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kvring`, else `~/.cache/kvring`, else the temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVRING_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("kvring");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("kvring");
    }
    std::env::temp_dir().join("kvring-cache")
}

/// PTX of the kernels for `sm_XY`, from the disk cache or NVRTC.
pub fn ptx_for(major: i32, minor: i32) -> Result<(String, String), GpuError> {
    let arch = format!("sm_{major}{minor}");
    let key = blake3::hash(format!("{arch}\n{KV_COPY_SRC}").as_bytes());
    let path = cache_dir().join(format!("kv_copy-{arch}-{}.ptx", &key.to_hex()[..16]));
    if let Ok(p) = std::fs::read_to_string(&path) {
        return Ok((p, format!("cached at {}", path.display())));
    }
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::Kernels(format!(
            "libnvrtc is not installed and {} holds no compiled kernels",
            path.display()
        )));
    }
    let t = std::time::Instant::now();
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        KV_COPY_SRC,
        cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={arch}")],
            name: Some("kv_copy.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|e| GpuError::Kernels(format!("NVRTC: {e:?}")))?
    .to_src();
    let origin = format!("compiled for {arch} in {} ms", t.elapsed().as_millis());
    // A failed cache write only costs the next start a compile.
    if std::fs::create_dir_all(path.parent().expect("a parent")).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((ptx, origin))
}

impl Kernels {
    /// Loads the kernels into `ctx` (compiling them if needed).
    pub fn load(ctx: &std::sync::Arc<Context>) -> Result<Kernels, GpuError> {
        let (major, minor) = ctx.info.compute_capability;
        let (ptx, origin) = ptx_for(major, minor)?;
        let module = Module::load(ctx, &ptx)?;
        let kv_copy = module.function(c"kv_copy")?;
        let kv_gate = module.function(c"kv_gate")?;
        Ok(Kernels {
            module,
            kv_copy,
            kv_gate,
            origin,
        })
    }

    /// Queues `kv_gate` on `stream` (one thread): the job-words check before
    /// a copy launched with the same `args` (see [`KvCopyArgs::entered`]).
    ///
    /// # Safety
    /// `args.entered` and `args.cancel` must be device addresses of words of
    /// device-mapped host memory and `args.verdict` of a device word, all
    /// valid until the kernel has run.
    pub unsafe fn gate(&self, stream: &Stream, args: KvCopyArgs) -> Result<(), CudaError> {
        let mut a = args;
        let mut params = [&mut a as *mut KvCopyArgs as *mut c_void];
        let cfg = LaunchConfig {
            grid: 1,
            block: 1,
            shared_bytes: 0,
        };
        // SAFETY: one value for `kv_gate(KvCopyArgs)`, living through the
        // call; the addresses are the caller's contract.
        unsafe { self.module.launch(self.kv_gate, stream, cfg, &mut params) }
    }

    /// Queues `kv_copy` for one chunk on `stream`: one CTA per page (a
    /// block of one layer), or at most `max_ctas` (each then striding over
    /// several).
    ///
    /// # Safety
    /// `layers` must hold the registration's `num_layers` [`LayerEntry`]s
    /// and `blocks` `blocks_per_chunk` block ids (both in device memory of
    /// this context, valid until the launch completes); every block id must
    /// be below the layout's block count, the layout validated against the
    /// memory the entries address, and `args` built from its plan with a
    /// `vec` dividing every address; `object` must address the chunk
    /// object's bytes, device-accessible.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        layers: u64,
        blocks: u64,
        object: u64,
        args: KvCopyArgs,
        max_ctas: u32,
    ) -> Result<(), CudaError> {
        let pages = args.num_layers * args.blocks_per_chunk;
        let ctas = if max_ctas == 0 {
            pages
        } else {
            pages.min(max_ctas)
        }
        .max(1);
        let (mut b, mut k, mut o, mut a) = (layers, blocks, object, args);
        let mut params = [
            &mut b as *mut u64 as *mut c_void,
            &mut k as *mut u64 as *mut c_void,
            &mut o as *mut u64 as *mut c_void,
            &mut a as *mut KvCopyArgs as *mut c_void,
        ];
        let cfg = LaunchConfig {
            grid: ctas,
            block: 256,
            shared_bytes: 0,
        };
        // SAFETY: one value per parameter of `kv_copy(const LayerEntry*,
        // const u32*, u8*, KvCopyArgs)`, of those types, living through the call
        // (the driver copies them); the addresses are the caller's contract.
        unsafe { self.module.launch(self.kv_copy, stream, cfg, &mut params) }
    }
}
