//! Loaded modules and their functions.

use super::{check, sys, Context, CudaError, Stream};
use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;

/// A module loaded from PTX into one context, unloaded on drop.
pub struct Module {
    ctx: Arc<Context>,
    module: sys::CUmodule,
}

// SAFETY: a module handle is usable from any thread with its context bound.
unsafe impl Send for Module {}
// SAFETY: looking functions up and launching them is thread-safe in the
// driver.
unsafe impl Sync for Module {}

/// A kernel of a loaded [`Module`] (valid while the module is).
#[derive(Clone, Copy)]
pub struct Function {
    f: sys::CUfunction,
}

// SAFETY: a function handle is usable from any thread with its context
// bound.
unsafe impl Send for Function {}
// SAFETY: as for `Send`.
unsafe impl Sync for Function {}

/// A launch's grid, block and dynamic shared memory.
#[derive(Clone, Copy, Debug)]
pub struct LaunchConfig {
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

impl Module {
    /// Loads `ptx` into `ctx`.
    pub fn load(ctx: &Arc<Context>, ptx: &str) -> Result<Module, CudaError> {
        let src = CString::new(ptx).map_err(|_| CudaError {
            call: "cuModuleLoadData (PTX with a NUL byte)",
            code: sys::CUresult::CUDA_ERROR_INVALID_IMAGE,
        })?;
        ctx.bind()?;
        let mut module = std::ptr::null_mut();
        check(
            // SAFETY: `module` is a valid out-pointer; `src` is a NUL-terminated
            // PTX image that lives through the call; unloaded in `Drop`.
            unsafe { sys::cuModuleLoadData(&mut module, src.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        Ok(Module {
            ctx: ctx.clone(),
            module,
        })
    }

    /// The kernel named `name`.
    pub fn function(&self, name: &CStr) -> Result<Function, CudaError> {
        self.ctx.bind()?;
        let mut f = std::ptr::null_mut();
        check(
            // SAFETY: `f` is a valid out-pointer; `name` is NUL-terminated.
            unsafe { sys::cuModuleGetFunction(&mut f, self.module, name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        Ok(Function { f })
    }

    /// Queues `f` (a function of this module) on `stream`.
    ///
    /// # Safety
    /// `f` must come from this module ([`Module::function`]; a function
    /// handle is valid only while its module is loaded). `params` must point
    /// to one value per kernel parameter, each of the kernel's parameter
    /// type; every address those values carry must stay valid for what the
    /// kernel does with it until the launch completes on `stream`.
    pub unsafe fn launch(
        &self,
        f: Function,
        stream: &Stream,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract; `f` belongs to this live module and
        // `stream` is live.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f.f,
                    cfg.grid,
                    1,
                    1,
                    cfg.block,
                    1,
                    1,
                    cfg.shared_bytes,
                    stream.raw(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: unloads the module loaded in `load`, once, in its context.
        let _ = unsafe { sys::cuModuleUnload(self.module) };
    }
}
