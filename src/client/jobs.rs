//! Asynchronous jobs from the client's side: the [`Job`] handle (status and
//! progress are reads of shared memory, no round trip; a wait is the futex
//! path with a deadline), the [`DelayJob`] request, and the calls by id for
//! jobs a handle no longer owns.

use super::connect::Link;
use super::words::{GaveUp, QUIESCE_BOUND};
use super::{Client, Release, Releases};
use crate::error::{Error, Result};
use crate::jobs::{FailReason, JobId, JobInfo, JobResult, JobStatus};
use crate::proto::{DelayJobRequest, Opcode};
use crate::wait::{self, WaitEnd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A job this client submitted (a store, a retrieve, a delay job).
///
/// Its status, info and progress are reads of the server's job table in
/// shared memory (no round trip); [`Job::wait`] parks on this client's
/// doorbell until the server says the job ended.
///
/// Dropping a `Job` releases its slot in the job table: the release is
/// queued with the client, which sends RELEASE_JOB with its next synchronous
/// request once the job has finished (an unfinished job is never cut short;
/// it runs to its end and is released then). If the client closes first, the
/// server releases it with the rest of the connection. [`Job::into_id`]
/// detaches the id instead: the caller then releases it with
/// [`Client::release_job`] (or leaves it to the disconnect).
///
/// # Examples
///
/// ```
/// use kvring::{Client, DelayJob};
/// use kvring_server::ServerConfig;
/// use kvring::jobs::JobStatus;
/// use std::time::{Duration, Instant};
///
/// # let pid = std::process::id();
/// # let name = format!("doc-job-{pid}");
/// # let dir = std::env::temp_dir().join(format!("kvring-doc-job-{pid}"));
/// # let mut cfg = ServerConfig::new(&name);
/// # cfg.runtime_dir = dir.clone();
/// # cfg.cache.pool_bytes = 8 << 20;
/// # cfg.copy.backend = kvring_server::BackendChoice::Host;
/// # let server = kvring_server::start(cfg)?;
/// let mut client = Client::builder(&name).runtime_dir(&dir).connect()?;
/// let job = client.delay_job(
///     DelayJob::new(Duration::ZERO, Duration::from_millis(20)).result(42, 7),
/// )?;
/// match job.wait(Instant::now() + Duration::from_secs(5))? {
///     JobStatus::Done(r) => assert_eq!((r.value, r.aux), (42, 7)),
///     other => panic!("{other:?}"),
/// }
/// drop(job); // released with the client's next request
/// # client.close();
/// # server.stop();
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a Job releases it; keep it to wait on it"]
pub struct Job {
    id: JobId,
    link: Arc<Link>,
    releases: Arc<Releases>,
    detached: bool,
    /// A STORE's or RETRIEVE's entry and generation in the job words.
    word: Option<(u32, u32)>,
    /// The layer groups of a RETRIEVE (1 for any other job).
    groups: u32,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.id).finish()
    }
}

impl Job {
    pub(super) fn new(id: JobId, link: Arc<Link>, releases: Arc<Releases>) -> Job {
        Job {
            id,
            link,
            releases,
            detached: false,
            word: None,
            groups: 1,
        }
    }

    /// A STORE or RETRIEVE, with its entry and generation in the job words
    /// and its layer groups.
    pub(super) fn with_word(mut self, entry: u32, generation: u32, groups: u32) -> Job {
        self.word = Some((entry, generation));
        self.groups = groups.max(1);
        self
    }

    /// The layer groups its layers land in (1 unless a RETRIEVE asked for
    /// more: `Retrieve::layer_groups`).
    pub fn layer_groups(&self) -> u32 {
        self.groups
    }

    /// The value of its `landed` word once group `group` (and every group
    /// before it) landed ([`crate::job_words`]); `None` for a job without
    /// job words or a group past its last.
    pub(crate) fn landed_target(&self, group: u32) -> Option<(u32, u32)> {
        let (e, g) = self.word?;
        (group < self.groups).then(|| (e, g.wrapping_sub(self.groups).wrapping_add(group + 1)))
    }

    /// Whether layer group `group` landed: its copies (and those of every
    /// group before it) are over, or the job was given up or released.
    /// Always true for a job that has no layer groups (not a STORE or
    /// RETRIEVE).
    pub fn layer_group_landed(&self, group: u32) -> bool {
        self.landed_target(group.min(self.groups - 1))
            .is_none_or(|(e, v)| self.link.words().landed_at(e, v))
    }

    /// Waits until layer group `group` landed (see
    /// [`Job::layer_group_landed`]), polling its job word with a short
    /// backoff. If the job ends first, or its own deadline passes, or its
    /// server is gone, this is [`Job::wait`] (which gives the job up in the
    /// last two cases, so no copy of it lands afterwards); at `deadline`
    /// `Error::Timeout` with the job still running.
    pub fn wait_layer_group(&self, group: u32, deadline: Instant) -> Result<()> {
        let Some((e, g)) = self.word else {
            return self.wait(deadline).map(drop);
        };
        let own = self.link.words.deadline(e, g);
        let start = Instant::now();
        let mut pause = Duration::from_micros(2);
        loop {
            if self.layer_group_landed(group) {
                return Ok(());
            }
            let now = Instant::now();
            let ended = !matches!(self.status(), Ok(JobStatus::Pending | JobStatus::Running));
            if ended || own.is_some_and(|o| now >= o) {
                return self.wait(deadline).map(drop);
            }
            if now >= deadline {
                return Err(Error::Timeout(now - start));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_micros(100));
        }
    }

    /// Its entry and generation in the job words (a STORE or RETRIEVE).
    #[cfg(feature = "cuda")]
    pub(crate) fn word(&self) -> Option<(u32, u32)> {
        self.word
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn link(&self) -> &Arc<Link> {
        &self.link
    }

    /// Gives the job up now (a STORE or RETRIEVE; other jobs are left as
    /// they are): no copy of it starts afterwards, one under way is waited
    /// for (at most `QUIESCE_BOUND`), streams waiting for it go on, and,
    /// unless the server had already settled it, a store does not commit.
    /// Its blocks are the engine's again once this returns `Ok`
    /// (`Error::CopiesInFlight`: a copy was still under way at the bound).
    /// A job the server already released is not changed.
    pub fn give_up(&self) -> Result<()> {
        self.give_up_within(QUIESCE_BOUND)
    }

    /// `give_up`, waiting at most `bound` for a copy under way: for a
    /// caller that must not wait longer and knows what a copy it leaves
    /// under way can do (one into its own process memory stops before its
    /// write once it sees the give-up; one a stopped server holds waits
    /// for that server whatever the bound).
    pub fn give_up_within(&self, bound: Duration) -> Result<()> {
        let Some((e, g)) = self.word else {
            return Ok(());
        };
        if self.link.words().released(e, g) && self.link.words().quiescent(e) {
            return Ok(());
        }
        match self
            .link
            .words
            .give_up_within(&self.link, e, g, GaveUp::Asked, bound)
        {
            Some(u) if !u.quiet => Err(Error::CopiesInFlight(self.id)),
            _ => Ok(()),
        }
    }

    /// Whether the job's word was released (a STORE or RETRIEVE): every
    /// copy of it is over, or it was given up, so a stream ordered after it
    /// (`EngineStream::wait_job`) goes on. Always true for other jobs.
    pub fn released(&self) -> bool {
        self.word
            .is_none_or(|(e, g)| self.link.words().released(e, g))
    }

    /// The job's id.
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The job's status, read from the job table in shared memory: no round
    /// trip, no syscall on a terminal answer. A non-terminal answer is only
    /// as good as the server's life, so at most every millisecond it also
    /// checks the server is still there (`Error::ServerGone` otherwise).
    #[inline]
    pub fn status(&self) -> Result<JobStatus> {
        status(&self.link, self.id)
    }

    /// Everything the job table says of it (kind, owner, progress,
    /// timestamps); `None` once its slot was reused.
    pub fn info(&self) -> Result<Option<JobInfo>> {
        Ok(self.link.jobs()?.info(self.id)?)
    }

    /// The job's progress counter (0 when its slot was reused).
    pub fn progress(&self) -> Result<u64> {
        Ok(self.info()?.map_or(0, |i| i.progress))
    }

    /// Waits until the job is terminal and returns its status. Ends with
    /// `Error::Timeout` (the time waited) at the deadline,
    /// `Error::ServerGone` as soon as the server's end of the connection
    /// closes, and `Error::ClientClosed` when the handle outlived its client.
    ///
    /// A STORE or RETRIEVE is given up at its own deadline (see
    /// `Store::timeout`) or when the server is gone, before this returns
    /// (`Timeout` or `ServerGone`): no copy of it touches the engine's
    /// memory afterwards. A wait whose deadline comes first returns
    /// `Timeout` with the job still running.
    pub fn wait(&self, deadline: Instant) -> Result<JobStatus> {
        let Some((e, g)) = self.word else {
            return wait_job(&self.link, self.id, deadline);
        };
        let words = &self.link.words;
        if let Some(u) = words.given_up(e, g) {
            return Err(u.error(self.id));
        }
        let own = words.deadline(e, g);
        let until = own.map_or(deadline, |d| d.min(deadline));
        let why = match wait_job(&self.link, self.id, until) {
            Ok(st) => {
                // A job given up meanwhile reports why it was.
                if let Some(u) = words.given_up(e, g) {
                    return Err(u.error(self.id));
                }
                words.ended(&self.link, e, g);
                return Ok(st);
            }
            Err(Error::ServerGone) => GaveUp::ServerGone,
            Err(Error::Timeout(d)) if own.is_some_and(|o| o <= deadline) => {
                GaveUp::Deadline(words.age(e, g).unwrap_or(d))
            }
            Err(other) => return Err(other),
        };
        match words.give_up(&self.link, e, g, why) {
            Some(u) => Err(u.error(self.id)),
            // Ended meanwhile (its entry is free again).
            None => wait_job(&self.link, self.id, deadline),
        }
    }

    /// Detaches the id: nothing is released when the handle goes; the caller
    /// releases it by id ([`Client::release_job`]) or leaves it to the
    /// disconnect.
    pub fn into_id(mut self) -> JobId {
        self.detached = true;
        self.id
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.detached {
            self.releases.push(Release::Job(self.id));
        }
    }
}

/// A delay job: a job that waits `pending`, then runs `running` (counting
/// progress every `progress_every`), then ends with a result or a failure.
/// It exercises the whole job path (table, timers, wake-ups) for health
/// checks, tests and benchmarks.
#[derive(Clone, Copy, Debug)]
#[must_use = "a request does nothing until submitted with Client::delay_job"]
pub struct DelayJob {
    req: DelayJobRequest,
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl DelayJob {
    /// A job pending for `pending`, then running for `running`, ending with
    /// result (0, 0).
    pub fn new(pending: Duration, running: Duration) -> DelayJob {
        DelayJob {
            req: DelayJobRequest {
                pending_us: micros(pending),
                running_us: micros(running),
                ..Default::default()
            },
        }
    }

    /// Counts progress every `every` while running.
    pub fn progress_every(mut self, every: Duration) -> Self {
        self.req.progress_every_us = micros(every);
        self
    }

    /// The result it ends with.
    pub fn result(mut self, value: u64, aux: u64) -> Self {
        self.req.result_value = value;
        self.req.result_aux = aux;
        self
    }

    /// Ends with this failure instead of a result.
    pub fn fail(mut self, reason: FailReason) -> Self {
        self.req.fail_reason = reason.code();
        self
    }
}

impl Client {
    /// Starts a delay job.
    pub fn delay_job(&mut self, req: DelayJob) -> Result<Job> {
        req.req
            .validate()
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        self.submit_job(Opcode::DelayJob, bytemuck::bytes_of(&req.req))
    }

    /// Submits a request that answers with a job id, and wraps the id.
    pub(super) fn submit_job(&mut self, op: Opcode, payload: &[u8]) -> Result<Job> {
        let deadline = Instant::now() + self.opts.call_timeout;
        self.submit_job_by(op, payload, deadline)
    }

    /// [`Client::submit_job`], answered by `deadline`.
    pub(super) fn submit_job_by(&mut self, op: Opcode, payload: &[u8], deadline: Instant) -> Result<Job> {
        let reply = self.call_large(op, payload, deadline)?;
        self.job_reply(&reply)
    }

    /// The job a submission's reply names.
    pub(super) fn job_reply(&self, reply: &[u8]) -> Result<Job> {
        if reply.len() != std::mem::size_of::<JobId>() {
            return Err(Error::Protocol(format!(
                "job submission answered {} bytes, expected a 16-byte job id",
                reply.len()
            )));
        }
        let id = bytemuck::pod_read_unaligned(reply);
        Ok(self.job_handle(id))
    }

    pub(super) fn job_handle(&self, id: JobId) -> Job {
        Job::new(id, self.link.clone(), self.releases.clone())
    }

    /// The status of any job of this server by id (one of another client,
    /// or a detached one); see [`Job::status`].
    #[inline]
    pub fn job_status(&self, id: JobId) -> Result<JobStatus> {
        status(&self.link, id)
    }

    /// Everything the job table says of a job by id; `None` for an id this
    /// server never issued or whose slot was reused since.
    pub fn job_info(&self, id: JobId) -> Result<Option<JobInfo>> {
        Ok(self.link.jobs()?.info(id)?)
    }

    /// Waits for any job by id; see [`Job::wait`]. A job of another client
    /// is polled with a backoff up to 1 ms (only the owner's doorbell rings).
    pub fn wait_job(&self, id: JobId, deadline: Instant) -> Result<JobStatus> {
        wait_job(&self.link, id, deadline)
    }

    /// Releases a finished job now: its slot becomes a tombstone (the
    /// outcome stays readable) and may be reused later. Takes a [`Job`] or
    /// a detached [`JobId`]. A handle is consumed only when the release
    /// went through; on an error it is dropped, which queues its release
    /// again, so nothing is lost. Releasing twice is harmless; releasing an
    /// unfinished job fails with `JobNotFinished`.
    pub fn release_job(&mut self, job: impl ToRelease) -> Result<()> {
        let id = job.job_id();
        self.call_now(Opcode::ReleaseJob, bytemuck::bytes_of(&id))?;
        job.released();
        Ok(())
    }
}

/// What [`Client::release_job`] takes: a [`Job`] handle or a [`JobId`].
pub trait ToRelease: private::Sealed {
    #[doc(hidden)]
    fn job_id(&self) -> JobId;
    /// The release went through: a handle has nothing left to release.
    #[doc(hidden)]
    fn released(self);
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::Job {}
    impl Sealed for crate::jobs::JobId {}
}

impl ToRelease for Job {
    fn job_id(&self) -> JobId {
        self.id
    }
    fn released(self) {
        let _ = self.into_id();
    }
}

impl ToRelease for JobId {
    fn job_id(&self) -> JobId {
        *self
    }
    fn released(self) {}
}

pub(super) fn status(link: &Link, id: JobId) -> Result<JobStatus> {
    let st = link.jobs()?.status(id)?;
    if !st.is_terminal() {
        link.check_alive()?;
    }
    Ok(st)
}

/// The result of a job that ended `Done`, `JobFailed` for one that failed.
pub(super) fn outcome(st: JobStatus) -> Result<JobResult> {
    match st {
        JobStatus::Done(r) | JobStatus::Tombstoned(Ok(r)) => Ok(r),
        JobStatus::Failed(r) | JobStatus::Tombstoned(Err(r)) => Err(Error::JobFailed(r)),
        other => Err(Error::Protocol(format!("job ended {other:?}"))),
    }
}

pub(super) fn wait_job(link: &Link, id: JobId, deadline: Instant) -> Result<JobStatus> {
    let reader = link.jobs()?;
    link.touch();
    let st = reader.status(id)?;
    if st.is_terminal() {
        return Ok(st);
    }
    let mine = reader
        .info(id)?
        .is_some_and(|i| i.owner_slot == link.slot && i.owner_session == link.session);
    let start = Instant::now();
    let conn = &link.conn;
    let r = if mine {
        wait::wait_until(
            &link.wait,
            link.parking(),
            deadline,
            || match reader.status(id) {
                Ok(s) if !s.is_terminal() => None,
                other => Some(other),
            },
            || if conn.peer_closed() { Err(()) } else { Ok(()) },
        )
    } else {
        poll_until(deadline, || match reader.status(id) {
            Ok(s) if !s.is_terminal() => {
                if conn.peer_closed() {
                    Some(Err(WaitEnd::Dead(())))
                } else {
                    None
                }
            }
            other => Some(Ok(other)),
        })
    };
    match r {
        Ok(s) => Ok(s?),
        Err(WaitEnd::Timeout) => Err(Error::Timeout(start.elapsed())),
        Err(WaitEnd::Dead(())) => Err(Error::ServerGone),
    }
}

/// Polls `f` until it answers or the deadline passes: spins briefly, then
/// sleeps with a backoff up to 1 ms.
fn poll_until<T>(
    deadline: Instant,
    mut f: impl FnMut() -> Option<Result<T, WaitEnd<()>>>,
) -> Result<T, WaitEnd<()>> {
    let mut pause = Duration::from_micros(1);
    loop {
        if let Some(r) = f() {
            return r;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitEnd::Timeout);
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}
