//! `kvring.Client`: a connection to a server, usable from any Python
//! thread; every call that may block runs without the GIL.

use crate::errors::{invalid, to_py};
use crate::handles::{PyJob, PyLease, PyPendingLookup, PyRegistration};
use crate::layout::PyLayout;
use kvring::client::Memory;
use kvring::kv::ChunkHash;
use kvring::{Client, DeviceUuid, IpcEventHandle, KvSpec, LeaseId, Lookup, Retrieve, Store};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[pyclass(name = "Client", module = "kvring", frozen)]
pub struct PyClient {
    client: Mutex<Option<Client>>,
    name: String,
}

impl PyClient {
    /// Runs `f` on the client (closed: `ClientClosed`), turning its error
    /// into the Python exception.
    ///
    /// The error becomes a Python exception only once the client's lock is
    /// released: making some exceptions takes the GIL, and a thread holding
    /// the GIL may be waiting for this lock.
    pub fn with<T>(&self, f: impl FnOnce(&mut Client) -> kvring::Result<T>) -> PyResult<T> {
        let r = {
            let mut guard = self.client.lock().unwrap_or_else(|e| e.into_inner());
            match guard.as_mut() {
                Some(c) => f(c),
                None => Err(kvring::Error::ClientClosed),
            }
        };
        r.map_err(to_py)
    }

    /// Runs `f` on the client and registration `reg` (client first, then
    /// the registration: the one lock order).
    fn with_registration<T>(
        &self,
        reg: &PyRegistration,
        f: impl FnOnce(&mut Client, &kvring::Registration) -> kvring::Result<T>,
    ) -> PyResult<T> {
        self.with(|c| {
            let guard = reg.reg.lock().unwrap_or_else(|e| e.into_inner());
            let r = guard.as_ref().ok_or(kvring::Error::InvalidArgument(
                "the registration was unregistered".into(),
            ))?;
            f(c, r)
        })
    }
}

/// The longest timeout taken (a year): beyond it a deadline could
/// overflow the clock.
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

pub fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    if (0.0..=MAX_SECONDS).contains(&s) {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(invalid(
            py,
            format!("{what} {s}: seconds, from 0 to {MAX_SECONDS} (a year)"),
        ))
    }
}

/// Chunk hashes from Python `bytes` (read in place: a 128-chunk prompt's
/// hashes cost no allocation each).
fn hashes(py: Python<'_>, hs: Vec<PyBackedBytes>) -> PyResult<Vec<ChunkHash>> {
    hs.iter()
        .enumerate()
        .map(|(i, h)| {
            <ChunkHash>::try_from(&h[..]).map_err(|_| {
                invalid(
                    py,
                    format!("hash {i}: {} bytes, chunk hashes are 16", h.len()),
                )
            })
        })
        .collect()
}

fn fixed<const N: usize>(py: Python<'_>, what: &str, b: &[u8]) -> PyResult<[u8; N]> {
    <[u8; N]>::try_from(b).map_err(|_| invalid(py, format!("{what}: {} bytes, need {N}", b.len())))
}

fn lease_id(py: Python<'_>, b: &[u8]) -> PyResult<LeaseId> {
    Ok(LeaseId::from_bytes(fixed::<16>(py, "lease id", b)?))
}

fn event(py: Python<'_>, after: Option<Vec<u8>>) -> PyResult<Option<IpcEventHandle>> {
    after
        .map(|b| {
            Ok(IpcEventHandle::from_bytes(fixed::<64>(
                py,
                "event handle",
                &b,
            )?))
        })
        .transpose()
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (name = "default", *, engine = None, runtime_dir = None, connect_timeout = 5.0, call_timeout = 10.0, wait = "default"))]
    fn new(
        py: Python<'_>,
        name: &str,
        engine: Option<&str>,
        runtime_dir: Option<std::path::PathBuf>,
        connect_timeout: f64,
        call_timeout: f64,
        wait: &str,
    ) -> PyResult<PyClient> {
        use kvring::wait::WaitPolicy;
        let policy = match wait {
            "default" => WaitPolicy::default(),
            "spin" => WaitPolicy::SPIN,
            "park" => WaitPolicy::PARK,
            other => {
                return Err(invalid(
                    py,
                    format!("wait {other:?}: \"default\", \"spin\" or \"park\""),
                ))
            }
        };
        let mut b = Client::builder(name)
            .wait_policy(policy)
            .connect_timeout(seconds(py, "connect_timeout", connect_timeout)?)
            .call_timeout(seconds(py, "call_timeout", call_timeout)?);
        if let Some(e) = engine {
            b = b.engine(e);
        }
        if let Some(d) = runtime_dir {
            b = b.runtime_dir(d);
        }
        let client = py.detach(|| b.connect()).map_err(to_py)?;
        Ok(PyClient {
            client: Mutex::new(Some(client)),
            name: name.to_owned(),
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Whether the server is known to be gone.
    #[getter]
    fn server_gone(&self, py: Python<'_>) -> bool {
        // Without the GIL: another thread may hold the client for a call.
        py.detach(|| {
            match self
                .client
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                Some(c) => c.server_gone(),
                None => true,
            }
        })
    }

    /// Seconds since the server last beat (every 50 ms while it runs).
    #[getter]
    fn server_heartbeat_age(&self, py: Python<'_>) -> PyResult<f64> {
        py.detach(|| self.with(|c| Ok(c.server_heartbeat_age().as_secs_f64())))
    }

    #[getter]
    fn server_pid(&self, py: Python<'_>) -> PyResult<u32> {
        py.detach(|| self.with(|c| Ok(c.server_pid())))
    }

    /// What engines must agree with: chunk_tokens, pool_bytes, copy_threads,
    /// max_request_bytes, lease_ttl_ms, backend.
    fn server_config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.with(|c| c.server_config()))?;
        let d = PyDict::new(py);
        d.set_item("chunk_tokens", r.chunk_tokens)?;
        d.set_item("copy_threads", r.copy_threads)?;
        d.set_item("pool_bytes", r.pool_bytes)?;
        d.set_item("max_request_bytes", r.max_request_bytes)?;
        d.set_item("lease_ttl_ms", r.lease_ttl_ms)?;
        let backend = kvring::proto::kv::BackendKind::decode(r.backend)
            .map(kvring::wire::WireEnum::wire_name)
            .unwrap_or("unknown");
        d.set_item("backend", backend)?;
        d.set_item(
            "kv_events",
            r.flags & kvring::proto::kv::ConfigFlags::EVENTS.bits() != 0,
        )?;
        Ok(d)
    }

    /// Tells a server that publishes KV events (`server_config()["kv_events"]`)
    /// the token ids of chunks `first_chunk ..` of a prompt, ahead of their
    /// stores, so that its events carry them. `tokens` is the prompt from
    /// its start; its whole chunks from `first_chunk` on are described.
    /// Posted, never waited for (a full ring raises).
    #[pyo3(signature = (tokens, *, model_id, chunk_tokens, salt = 0, first_chunk = 0))]
    fn describe(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        model_id: u64,
        chunk_tokens: u32,
        salt: u64,
        first_chunk: usize,
    ) -> PyResult<()> {
        py.detach(|| {
            self.with(|c| c.describe(model_id, salt, chunk_tokens, &tokens, first_chunk))
        })?;
        Ok(())
    }

    /// The cache's counters (pool, objects, leases, lookups, hits, stores,
    /// retrieves, evictions), as `kvring-inspect` names them.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.with(|c| c.stats()))?;
        let d = PyDict::new(py);
        if let serde_json::Value::Object(m) = serde_json::to_value(r).expect("plain counters") {
            for (k, v) in m {
                d.set_item(k, v.as_u64().unwrap_or(0))?;
            }
        }
        Ok(d)
    }

    /// Drops every stored object; returns {"objects": n, "bytes": b}.
    fn clear<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.with(|c| c.clear()))?;
        let d = PyDict::new(py);
        d.set_item("objects", r.objects)?;
        d.set_item("bytes", r.bytes)?;
        Ok(d)
    }

    #[pyo3(signature = (payload = b"".to_vec(), timeout = 5.0))]
    fn ping<'py>(
        &self,
        py: Python<'py>,
        payload: Vec<u8>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let deadline = Instant::now() + seconds(py, "timeout", timeout)?;
        let r = py.detach(|| self.with(|c| c.ping(&payload, deadline)))?;
        Ok(PyBytes::new(py, &r))
    }

    /// Registers a KV cache in this process's own memory: allocation i of
    /// `layout` at addresses[i].
    #[pyo3(signature = (layout, addresses, *, model_id, world_size = 1, rank = 0, device = None))]
    #[allow(clippy::too_many_arguments)]
    fn register_process_memory(
        slf: &Bound<'_, Self>,
        layout: Bound<'_, PyLayout>,
        addresses: Vec<u64>,
        model_id: u64,
        world_size: u32,
        rank: u32,
        device: Option<Vec<u8>>,
    ) -> PyResult<PyRegistration> {
        let py = slf.py();
        let mut spec = KvSpec::new(model_id, world_size, rank);
        if let Some(d) = device {
            spec = spec.on_device(DeviceUuid::from_bytes(fixed::<16>(py, "device", &d)?));
        }
        let memory = Memory::process(addresses);
        register(slf, layout, &spec, &memory)
    }

    /// Registers device memory: allocation i at `offset` of the cuMemAlloc
    /// allocation whose 64-byte IPC handle is given.
    #[pyo3(signature = (layout, handles, *, model_id, world_size = 1, rank = 0, device))]
    #[allow(clippy::too_many_arguments)]
    fn register_cuda_ipc(
        slf: &Bound<'_, Self>,
        layout: Bound<'_, PyLayout>,
        handles: Vec<(Vec<u8>, u64)>,
        model_id: u64,
        world_size: u32,
        rank: u32,
        device: Vec<u8>,
    ) -> PyResult<PyRegistration> {
        let py = slf.py();
        let spec = KvSpec::new(model_id, world_size, rank)
            .on_device(DeviceUuid::from_bytes(fixed::<16>(py, "device", &device)?));
        let handles = handles
            .into_iter()
            .map(|(h, off)| Ok((fixed::<64>(py, "IPC handle", &h)?, off)))
            .collect::<PyResult<Vec<_>>>()?;
        register(slf, layout, &spec, &Memory::cuda_ipc(handles))
    }

    /// Registers an engine's own device memory where it is (torch CUDA
    /// tensors): allocation i of `layout` starts at device address
    /// addresses[i] (a tensor's `data_ptr()`). The driver says which
    /// allocation holds it and how to share it (a cudaMalloc block's IPC
    /// handle, or VMM memory's POSIX fds) and on which device.
    #[cfg(feature = "cuda")]
    #[pyo3(signature = (layout, addresses, *, model_id, world_size = 1, rank = 0))]
    fn register_cuda_memory(
        slf: &Bound<'_, Self>,
        layout: Bound<'_, PyLayout>,
        addresses: Vec<u64>,
        model_id: u64,
        world_size: u32,
        rank: u32,
    ) -> PyResult<PyRegistration> {
        let py = slf.py();
        let l = layout.get().layout.clone();
        let sizes = l.allocations();
        if sizes.len() != addresses.len() {
            return Err(invalid(
                py,
                format!(
                    "the layout has {} allocations, {} addresses were given",
                    sizes.len(),
                    addresses.len()
                ),
            ));
        }
        let ranges: Vec<(u64, u64)> = addresses.into_iter().zip(sizes.iter().copied()).collect();
        let spec = KvSpec::new(model_id, world_size, rank);
        let me = slf.get();
        let reg = py.detach(|| {
            let memory = kvring::client::CudaMemory::of(&ranges).map_err(to_py)?;
            me.with(|c| c.register_cuda_memory(&spec, &l, &memory))
        })?;
        Ok(PyRegistration::new(
            reg,
            layout.unbind(),
            slf.clone().unbind(),
        ))
    }

    /// Unregisters now (the server unmaps once copies in flight finished).
    fn unregister(&self, py: Python<'_>, reg: &Bound<'_, PyRegistration>) -> PyResult<()> {
        reg.get().unregister(py)
    }

    /// LOOKUP: a lease on the leading chunks every rank has.
    #[pyo3(signature = (model_id, world_size, hashes, *, salt = 0))]
    fn lookup(
        slf: &Bound<'_, Self>,
        model_id: u64,
        world_size: u32,
        hashes: Vec<PyBackedBytes>,
        salt: u64,
    ) -> PyResult<PyLease> {
        let py = slf.py();
        let hs = self::hashes(py, hashes)?;
        let me = slf.get();
        let lease =
            py.detach(|| me.with(|c| c.lookup(Lookup::new(model_id, world_size, &hs).salt(salt))))?;
        Ok(PyLease::new(lease, slf.clone().unbind()))
    }

    /// LOOKUP without waiting for the answer: the server takes it within
    /// `timeout` seconds (else ServerTimeout: a stopped server), and the
    /// returned PendingLookup is polled for the lease.
    #[pyo3(signature = (model_id, world_size, hashes, *, salt = 0, timeout = 1.0))]
    fn submit_lookup(
        slf: &Bound<'_, Self>,
        model_id: u64,
        world_size: u32,
        hashes: Vec<PyBackedBytes>,
        salt: u64,
        timeout: f64,
    ) -> PyResult<PyPendingLookup> {
        let py = slf.py();
        let hs = self::hashes(py, hashes)?;
        let deadline = Instant::now() + seconds(py, "timeout", timeout)?;
        let me = slf.get();
        let pending = py.detach(|| {
            me.with(|c| {
                c.submit_lookup(Lookup::new(model_id, world_size, &hs).salt(salt), deadline)
            })
        })?;
        Ok(PyPendingLookup::new(pending, slf.clone().unbind()))
    }

    /// Frees a lease's holds on chunks first_chunk .. +n_chunks that will
    /// not be retrieved. `post=True`: posted, never waited for (a full ring
    /// raises; the holds then go with the lease's end).
    #[pyo3(signature = (lease_id, first_chunk, n_chunks, *, post = false))]
    fn release_lease_chunks(
        &self,
        py: Python<'_>,
        lease_id: Vec<u8>,
        first_chunk: u32,
        n_chunks: u32,
        post: bool,
    ) -> PyResult<()> {
        let id = self::lease_id(py, &lease_id)?;
        py.detach(|| {
            self.with(|c| {
                if post {
                    c.post_release_lease_chunks(id, first_chunk, n_chunks)
                } else {
                    c.release_lease_chunks(id, first_chunk, n_chunks)
                }
            })
        })
    }

    /// Ends a lease known by id (END_SESSION).
    fn end_lease(&self, py: Python<'_>, lease_id: Vec<u8>) -> PyResult<()> {
        let id = self::lease_id(py, &lease_id)?;
        py.detach(|| self.with(|c| c.end_lease_id(id)))
    }

    /// STORE: copies the chunks `hashes` from `blocks` (blocks_per_chunk
    /// per chunk, the last chunk 1 to blocks_per_chunk) into the cache, as
    /// a job. `submit_timeout`: how long the
    /// call waits for the server to take it (default: the call timeout).
    #[pyo3(signature = (reg, hashes, blocks, *, timeout = None, salt = 0, after = None, submit_timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        py: Python<'_>,
        reg: &Bound<'_, PyRegistration>,
        hashes: Vec<PyBackedBytes>,
        blocks: Vec<u32>,
        timeout: Option<f64>,
        salt: u64,
        after: Option<Vec<u8>>,
        submit_timeout: Option<f64>,
    ) -> PyResult<PyJob> {
        let hs = self::hashes(py, hashes)?;
        let after = event(py, after)?;
        let timeout = timeout.map(|t| seconds(py, "timeout", t)).transpose()?;
        let within = submit_timeout
            .map(|t| seconds(py, "submit_timeout", t))
            .transpose()?;
        let reg = reg.get();
        let job = py.detach(|| {
            self.with_registration(reg, |c, r| {
                let mut s = Store::new(r, &hs, &blocks).salt(salt);
                if let Some(t) = timeout {
                    s = s.timeout(t);
                }
                if let Some(t) = within {
                    s = s.submit_within(t);
                }
                if let Some(e) = after {
                    s = s.after(e);
                }
                c.store(s)
            })
        })?;
        Ok(PyJob::new(job))
    }

    /// RETRIEVE: copies the lease's chunks from first_chunk into `blocks`,
    /// as a job (`submit_timeout` as for `store`).
    #[pyo3(signature = (reg, lease_id, blocks, *, first_chunk = 0, skip_tokens = 0, timeout = None, after = None, layer_groups = 1, submit_timeout = None))]
    #[allow(clippy::too_many_arguments)]
    fn retrieve(
        &self,
        py: Python<'_>,
        reg: &Bound<'_, PyRegistration>,
        lease_id: Vec<u8>,
        blocks: Vec<u32>,
        first_chunk: u32,
        skip_tokens: u32,
        timeout: Option<f64>,
        after: Option<Vec<u8>>,
        layer_groups: u32,
        submit_timeout: Option<f64>,
    ) -> PyResult<PyJob> {
        let id = self::lease_id(py, &lease_id)?;
        let after = event(py, after)?;
        let timeout = timeout.map(|t| seconds(py, "timeout", t)).transpose()?;
        let within = submit_timeout
            .map(|t| seconds(py, "submit_timeout", t))
            .transpose()?;
        let reg = reg.get();
        let job = py.detach(|| {
            self.with_registration(reg, |c, r| {
                let mut q = Retrieve::new(r, id, &blocks)
                    .first_chunk(first_chunk)
                    .skip_tokens(skip_tokens)
                    .layer_groups(layer_groups);
                if let Some(t) = timeout {
                    q = q.timeout(t);
                }
                if let Some(t) = within {
                    q = q.submit_within(t);
                }
                if let Some(e) = after {
                    q = q.after(e);
                }
                c.retrieve(q)
            })
        })?;
        Ok(PyJob::new(job))
    }

    /// A job that waits `pending` seconds, then runs `running` seconds and
    /// ends with (value, aux): the job path end to end, without KV.
    #[pyo3(signature = (pending, running, *, value = 0, aux = 0))]
    fn delay_job(
        &self,
        py: Python<'_>,
        pending: f64,
        running: f64,
        value: u64,
        aux: u64,
    ) -> PyResult<PyJob> {
        let req = kvring::DelayJob::new(
            seconds(py, "pending", pending)?,
            seconds(py, "running", running)?,
        )
        .result(value, aux);
        let job = py.detach(|| self.with(|c| c.delay_job(req)))?;
        Ok(PyJob::new(job))
    }

    /// Says goodbye; the server reclaims what the connection held.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let c = self.client.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(c) = c {
                c.close();
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py)
    }

    fn __repr__(&self) -> String {
        format!("Client({:?})", self.name)
    }
}

fn register(
    slf: &Bound<'_, PyClient>,
    layout: Bound<'_, PyLayout>,
    spec: &KvSpec,
    memory: &Memory,
) -> PyResult<PyRegistration> {
    let py = slf.py();
    let l = layout.get().layout.clone();
    let me = slf.get();
    let reg = py.detach(|| me.with(|c| c.register(spec, &l, memory, &[])))?;
    Ok(PyRegistration::new(
        reg,
        layout.unbind(),
        slf.clone().unbind(),
    ))
}
