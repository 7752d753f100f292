//! `kvring.EngineStream`: an engine's CUDA stream (a torch stream) made to
//! wait on the device for STORE and RETRIEVE jobs, through words the
//! client releases itself when it gives a job up, so the stream never waits
//! for a server that stalled or died.

use crate::errors::{to_py, KvringError};
use crate::handles::PyJob;
use kvring::client::cuda_cache::EngineStream;
use pyo3::prelude::*;
use std::sync::Mutex;

#[pyclass(name = "EngineStream", module = "kvring", frozen)]
pub struct PyEngineStream {
    stream: Mutex<Option<EngineStream>>,
}

impl PyEngineStream {
    /// Runs `f` on the stream; called without the GIL (a synchronize may
    /// hold the stream a while), and its error becomes an exception after
    /// the lock is released.
    fn with<T>(&self, f: impl FnOnce(&EngineStream) -> kvring::Result<T>) -> PyResult<T> {
        let r = {
            let g = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(f)
        };
        match r {
            Some(r) => r.map_err(to_py),
            None => Err(KvringError::new_err("the engine stream was closed")),
        }
    }
}

#[pymethods]
impl PyEngineStream {
    /// Stream `stream` (torch: `torch.cuda.current_stream().cuda_stream`;
    /// 0 is the legacy default stream) of CUDA device `device`. It must
    /// outlive this object (close it before the stream goes).
    #[new]
    fn new(py: Python<'_>, device: i32, stream: u64) -> PyResult<PyEngineStream> {
        // SAFETY: the caller's contract, stated above and in the stub: a
        // live stream of the device's primary context (the one torch uses)
        // that outlives this object.
        let s = py
            .detach(|| unsafe { EngineStream::borrow(device, stream) })
            .map_err(to_py)?;
        Ok(PyEngineStream {
            stream: Mutex::new(Some(s)),
        })
    }

    /// Makes later work on the stream wait (on the device) until `job` is
    /// over (released by the server once its copies ended, or by this
    /// client when it gives the job up: at its timeout, or when the server
    /// is gone).
    fn wait_job(&self, py: Python<'_>, job: &Bound<'_, PyJob>) -> PyResult<()> {
        let j = job.get().arc()?;
        py.detach(|| self.with(|s| s.wait_job(&j)))
    }

    /// Makes later work on the stream wait (on the device) until layer
    /// group `group` of `job` (a RETRIEVE in layer groups) landed, with
    /// every group before it; bounded as `wait_job` is.
    fn wait_layer_group(&self, py: Python<'_>, job: &Bound<'_, PyJob>, group: u32) -> PyResult<()> {
        let j = job.get().arc()?;
        py.detach(|| self.with(|s| s.wait_layer_group(&j, group)))
    }

    /// Waits (on the host, without the GIL) for everything queued.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.with(|s| s.synchronize()))
    }

    /// Gives up the jobs it waited for that are not released yet and
    /// drains the stream.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let s = self.stream.lock().unwrap_or_else(|e| e.into_inner()).take();
            drop(s)
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py)
    }
}
