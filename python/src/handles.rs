//! The handles a client hands out: `Job`, `Lease`, `Registration`, and the
//! `JobStatus` a job's slot reads. Each releases what it holds when
//! released explicitly, at the end of a `with` block, or when collected.

use crate::client::PyClient;
use crate::errors::to_py;
use crate::layout::PyLayout;
use kvring::jobs::{JobResult, JobStatus};
use kvring::{Job, Lease, LeaseId, LookupPoll, PendingLookup, Registration};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A job's state, read from shared memory.
#[pyclass(name = "JobStatus", module = "kvring", frozen, get_all)]
pub struct PyJobStatus {
    /// "pending", "running", "done", "failed", "tombstoned", "expired",
    /// "unknown".
    state: &'static str,
    value: u64,
    aux: u64,
    /// The failure's stable name (failed, or tombstoned with a failure).
    reason: Option<&'static str>,
}

impl From<JobStatus> for PyJobStatus {
    fn from(st: JobStatus) -> PyJobStatus {
        let (state, r): (_, Option<Result<JobResult, _>>) = match st {
            JobStatus::Pending => ("pending", None),
            JobStatus::Running => ("running", None),
            JobStatus::Done(r) => ("done", Some(Ok(r))),
            JobStatus::Failed(f) => ("failed", Some(Err(f))),
            JobStatus::Tombstoned(r) => ("tombstoned", Some(r)),
            JobStatus::Expired => ("expired", None),
            JobStatus::Unknown => ("unknown", None),
        };
        let (value, aux, reason) = match r {
            Some(Ok(r)) => (r.value, r.aux, None),
            Some(Err(f)) => (0, 0, Some(f.name())),
            None => (0, 0, None),
        };
        PyJobStatus {
            state,
            value,
            aux,
            reason,
        }
    }
}

#[pymethods]
impl PyJobStatus {
    /// It can no longer change state.
    #[getter]
    fn finished(&self) -> bool {
        !matches!(self.state, "pending" | "running")
    }

    /// Done (or tombstoned) with a result.
    #[getter]
    fn ok(&self) -> bool {
        matches!(self.state, "done" | "tombstoned") && self.reason.is_none()
    }

    fn __repr__(&self) -> String {
        match self.reason {
            Some(r) => format!("JobStatus({}, reason={r:?})", self.state),
            None => format!(
                "JobStatus({}, value={}, aux={})",
                self.state, self.value, self.aux
            ),
        }
    }
}

/// How long one slice of a blocking wait lasts: between slices the waiting
/// thread takes the GIL to see Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Runs `wait(slice)` without the GIL until it answers or `timeout`
/// seconds pass (None: far enough that the job's own deadline comes
/// first), taking the GIL between slices to see Ctrl-C.
fn sliced_wait<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    wait: impl Fn(Instant) -> kvring::Result<T> + Sync,
) -> PyResult<T> {
    let deadline = Instant::now()
        + match timeout {
            Some(t) => crate::client::seconds(py, "timeout", t)?,
            None => Duration::from_secs_f64(crate::client::MAX_SECONDS),
        };
    loop {
        let slice = deadline.min(Instant::now() + WAIT_SLICE);
        match py.detach(|| wait(slice)) {
            Ok(v) => return Ok(v),
            Err(kvring::Error::Timeout(_)) if slice < deadline => py.check_signals()?,
            Err(e) => return Err(to_py(e)),
        }
    }
}

/// A job (STORE, RETRIEVE, ...). The `Arc` is cloned out for each use, so a
/// thread blocked in `wait` never holds a lock another thread needs.
#[pyclass(name = "Job", module = "kvring", frozen)]
pub struct PyJob {
    job: Mutex<Option<Arc<Job>>>,
    id: (u64, u64),
}

impl PyJob {
    pub fn new(job: Job) -> PyJob {
        let id = job.id();
        PyJob {
            job: Mutex::new(Some(Arc::new(job))),
            id: (id.epoch, id.key),
        }
    }

    /// The job, for another handle's use (an engine stream's wait).
    pub fn arc(&self) -> PyResult<Arc<Job>> {
        self.get()
    }

    fn get(&self) -> PyResult<Arc<Job>> {
        self.job
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| crate::errors::KvringError::new_err("the job was released"))
    }
}

#[pymethods]
impl PyJob {
    /// (epoch, key): the job's id.
    #[getter]
    fn id(&self) -> (u64, u64) {
        self.id
    }

    /// Its state, read from shared memory (no system call).
    fn status(&self) -> PyResult<PyJobStatus> {
        Ok(self.get()?.status().map_err(to_py)?.into())
    }

    /// Its state without blocking, holding it to its own deadline: a STORE
    /// or RETRIEVE past its timeout, or whose server is gone, is given up
    /// (bounded) and raises ServerTimeout or ServerGone; otherwise the
    /// state, "pending" and "running" included.
    fn poll(&self, py: Python<'_>) -> PyResult<PyJobStatus> {
        let job = self.get()?;
        match py.detach(|| job.wait(Instant::now())) {
            Ok(st) => Ok(st.into()),
            Err(kvring::Error::Timeout(_)) => Ok(job.status().map_err(to_py)?.into()),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Waits until it finished, `timeout` seconds at most (None: until
    /// its own deadline), without the GIL.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyJobStatus> {
        let job = self.get()?;
        Ok(sliced_wait(py, timeout, |slice| job.wait(slice))?.into())
    }

    /// The layer groups its layers land in (1 unless a RETRIEVE asked for
    /// more).
    #[getter]
    fn layer_groups(&self) -> PyResult<u32> {
        Ok(self.get()?.layer_groups())
    }

    /// Waits (without the GIL) until layer group `group` of a RETRIEVE
    /// landed, `timeout` seconds at most (None: until its own deadline);
    /// a job that ends, passes its own deadline or loses its server first
    /// is waited for as `wait` does (given up in the last two cases).
    #[pyo3(signature = (group, timeout = None))]
    fn wait_layer_group(&self, py: Python<'_>, group: u32, timeout: Option<f64>) -> PyResult<()> {
        let job = self.get()?;
        sliced_wait(py, timeout, |slice| job.wait_layer_group(group, slice))
    }

    /// Whether layer group `group` landed (or the job was released).
    fn layer_group_landed(&self, group: u32) -> PyResult<bool> {
        Ok(self.get()?.layer_group_landed(group))
    }

    /// Gives it up: no copy of it starts afterwards; one under way is
    /// waited for (at most `timeout` seconds, default the library's bound).
    #[pyo3(signature = (timeout=None))]
    fn give_up(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let job = self.get()?;
        let bound = match timeout {
            Some(t) => crate::client::seconds(py, "timeout", t)?,
            None => kvring::client::QUIESCE_BOUND,
        };
        py.detach(|| job.give_up_within(bound)).map_err(to_py)
    }

    /// Whether streams ordered after it may go on.
    #[getter]
    fn released(&self) -> PyResult<bool> {
        Ok(self.get()?.released())
    }

    /// Releases its slot (sent with the client's next request).
    fn release(&self) {
        // Dropped after the lock: a Job's drop only queues its release.
        let job = self.job.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(job);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) {
        self.release()
    }

    fn __repr__(&self) -> String {
        format!("Job(epoch={}, key={:#x})", self.id.0, self.id.1)
    }
}

/// A LOOKUP submitted and not answered yet: `poll()` gives its Lease once
/// the server has answered. Dropped (or cancelled) unanswered, its lease
/// is ended once the lookup finishes.
#[pyclass(name = "PendingLookup", module = "kvring", frozen)]
pub struct PyPendingLookup {
    pending: Mutex<Option<PendingLookup>>,
    client: Py<PyClient>,
}

impl PyPendingLookup {
    pub fn new(pending: PendingLookup, client: Py<PyClient>) -> PyPendingLookup {
        PyPendingLookup {
            pending: Mutex::new(Some(pending)),
            client,
        }
    }
}

#[pymethods]
impl PyPendingLookup {
    /// The lease once the server has answered (waiting `timeout` seconds
    /// at most; 0: not at all), else None. Raises the lookup's failure,
    /// or KvringError once it was answered or cancelled.
    #[pyo3(signature = (timeout = 0.0))]
    fn poll(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<PyLease>> {
        let deadline = Instant::now() + crate::client::seconds(py, "timeout", timeout)?;
        let mut slot = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pending) = slot.take() else {
            return Err(to_py(kvring::Error::InvalidArgument(
                "this lookup was answered or cancelled already".into(),
            )));
        };
        let client = self.client.get();
        match py.detach(|| client.with(|c| c.poll_lookup(pending, deadline)))? {
            LookupPoll::Ready(lease) => Ok(Some(PyLease::new(lease, self.client.clone_ref(py)))),
            LookupPoll::Pending(p) => {
                *slot = Some(p);
                Ok(None)
            }
        }
    }

    /// Gives it up: its lease is ended once the lookup finishes.
    fn cancel(&self) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    fn __repr__(&self) -> String {
        match &*self.pending.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(_) => "PendingLookup(pending)".into(),
            None => "PendingLookup(done)".into(),
        }
    }
}

/// A LOOKUP's holds on the hit chunks.
#[pyclass(name = "Lease", module = "kvring", frozen)]
pub struct PyLease {
    lease: Mutex<Option<Lease>>,
    id: LeaseId,
    hits: u64,
    client: Py<PyClient>,
}

impl PyLease {
    pub fn new(lease: Lease, client: Py<PyClient>) -> PyLease {
        PyLease {
            id: lease.id(),
            hits: lease.hits(),
            lease: Mutex::new(Some(lease)),
            client,
        }
    }
}

#[pymethods]
impl PyLease {
    /// 16 bytes: what a worker's retrieve names.
    #[getter]
    fn id<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.id.to_bytes())
    }

    /// Leading chunks found for every rank.
    #[getter]
    fn hits(&self) -> u64 {
        self.hits
    }

    /// Ends it now (END_SESSION): frees what it still holds. `post=True`:
    /// posted, never waited for (a stopped server costs nothing; what finds
    /// no room in the rings goes with the client's next request).
    #[pyo3(signature = (*, post = false))]
    fn end(&self, py: Python<'_>, post: bool) -> PyResult<()> {
        let Some(lease) = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(());
        };
        let client = self.client.get();
        if post {
            return py.detach(|| {
                client.with(|c| {
                    c.post_end_lease(lease);
                    Ok(())
                })
            });
        }
        py.detach(|| client.with(|c| c.end_lease(lease)))
    }

    /// Keeps the holds past this handle; returns the id.
    fn detach<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        if let Some(lease) = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = lease.into_id();
        }
        self.id(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.end(py, false)
    }

    fn __repr__(&self) -> String {
        format!("Lease(hits={})", self.hits)
    }
}

/// A registered KV cache.
#[pyclass(name = "Registration", module = "kvring", frozen)]
pub struct PyRegistration {
    pub reg: Mutex<Option<Registration>>,
    id: u32,
    chunk_tokens: u32,
    blocks_per_chunk: u32,
    layout: Py<PyLayout>,
    client: Py<PyClient>,
}

impl PyRegistration {
    pub fn new(reg: Registration, layout: Py<PyLayout>, client: Py<PyClient>) -> PyRegistration {
        PyRegistration {
            id: reg.id(),
            chunk_tokens: reg.chunk_tokens(),
            blocks_per_chunk: reg.blocks_per_chunk(),
            reg: Mutex::new(Some(reg)),
            layout,
            client,
        }
    }

    /// Unregisters now.
    pub fn unregister(&self, py: Python<'_>) -> PyResult<()> {
        let client = self.client.get();
        py.detach(|| {
            client.with(
                |c| match self.reg.lock().expect("registration handle").take() {
                    Some(reg) => c.unregister(reg),
                    None => Ok(()),
                },
            )
        })
    }
}

#[pymethods]
impl PyRegistration {
    #[getter]
    fn id(&self) -> u32 {
        self.id
    }
    #[getter]
    fn chunk_tokens(&self) -> u32 {
        self.chunk_tokens
    }
    #[getter]
    fn blocks_per_chunk(&self) -> u32 {
        self.blocks_per_chunk
    }
    #[getter]
    fn layout(&self, py: Python<'_>) -> Py<PyLayout> {
        self.layout.clone_ref(py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.unregister(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Registration(id={}, chunk_tokens={}, blocks_per_chunk={})",
            self.id, self.chunk_tokens, self.blocks_per_chunk
        )
    }
}
