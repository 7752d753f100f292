//! The client library an engine links: connect to the node's kvring server,
//! register KV caches, and look up, store and retrieve chunks as jobs.
//!
//! The API is one of handles that release what they hold:
//!
//! * [`Job`] (a store, a retrieve, a delay job): wait on it, read its status
//!   and progress from shared memory; dropping it releases its job slot.
//! * [`Lease`] (a lookup): the chunks it found are held against eviction
//!   until a retrieve takes them or the lease ends; dropping it ends it.
//! * [`Registration`] (a KV cache the server maps): dropping it unregisters.
//!
//! A handle's drop never needs the [`Client`]: it pushes what it releases
//! onto a small queue shared with its client, and the client sends the
//! queue with its next synchronous request (a job's release once the job
//! has finished). When the client itself closes, the server reclaims
//! everything the connection held (jobs, leases, registrations) anyway.
//!
//! Requests are built with one builder per operation ([`Store`],
//! [`Retrieve`], [`Lookup`], [`DelayJob`]): required fields in `new`,
//! options as chained setters, then submitted by the client call of the same
//! name. Every call that can block takes a deadline (`Instant`); options
//! hold spans (`Duration`).
//!
//! Words: the wire keeps LMCache's names for a lookup's holds.
//! `END_SESSION` is [`Client::end_lease`] (and a [`Lease`]'s drop);
//! `FREE_LOOKUP_LOCKS` is [`Client::release_lease_chunks`]. A lease is
//! named by its lookup job's id ([`LeaseId`]).
//!
//! The ring level (frames, credits, completions, synchronous calls by
//! opcode) is behind [`Client::raw`].

mod channel;
mod connect;
pub mod cuda_cache;
mod cuda_memory;
mod host_cache;
mod jobs;
mod kv;
mod lease;
mod reconnect;
mod registration;
mod words;

pub use channel::{Completion, RawChannel};
#[cfg(feature = "cuda")]
pub use cuda_memory::CudaMemory;
pub use host_cache::HostKvCache;
pub use jobs::{DelayJob, Job, ToRelease};
pub use kv::{Retrieve, Store, DEFAULT_JOB_TIMEOUT};
pub use lease::{Lease, LeaseId, Lookup, LookupPoll, PendingLookup};
pub use registration::{KvSpec, Memory, Registration};
pub use words::{GaveUp, QUIESCE_BOUND};

use crate::error::{Error, Result};
use crate::jobs::JobId;
use crate::proto::kv::{ClearReply, ConfigReply, StatsReply};
use crate::proto::{Goodbye, Opcode};
use crate::ring::{Consumer, Producer};
use crate::rundir::ServerPaths;
use crate::segment::ClientSegment;
use crate::wait::WaitPolicy;
use connect::Link;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a client connects and waits. Filled by [`ClientBuilder`];
/// `Default` gives the values the builder starts from.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClientOptions {
    /// How long to keep retrying while the server is not up yet.
    pub connect_timeout: Duration,
    /// How waits spin, yield and park (`park_slice` is also how often a
    /// parked wait checks that the server is still there).
    pub wait: WaitPolicy,
    /// How long a synchronous request (a submission that returns a job, a
    /// control request, a registration) may wait for its answer.
    pub call_timeout: Duration,
    /// The engine this client belongs to (see [`ClientBuilder::engine`]);
    /// `None`: the anonymous engine.
    pub engine: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            wait: WaitPolicy::default(),
            call_timeout: Duration::from_secs(10),
            engine: None,
        }
    }
}

/// Connection settings for [`Client::builder`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until .connect()"]
pub struct ClientBuilder {
    name: String,
    dir: Option<PathBuf>,
    opts: ClientOptions,
}

impl ClientBuilder {
    /// The runtime directory the server's socket is in (default: the
    /// user's runtime directory, `KVRING_RUNTIME_DIR` if set).
    pub fn runtime_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// How long to keep retrying while the server is not up yet.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.opts.connect_timeout = d;
        self
    }

    /// How long a synchronous request may wait for its answer.
    pub fn call_timeout(mut self, d: Duration) -> Self {
        self.opts.call_timeout = d;
        self
    }

    /// The engine this client belongs to, by an id its scheduler and every
    /// worker share and other engines do not know (vLLM's
    /// `kv_transfer_config.engine_id`). A lease (a LOOKUP) can then be
    /// retrieved, freed or ended only by clients of this engine; others get
    /// `Status::ForeignLease`. Clients that name no engine share the
    /// anonymous one.
    pub fn engine(mut self, id: &str) -> Self {
        self.opts.engine = Some(id.to_string());
        self
    }

    /// How waits spin, yield and park.
    pub fn wait_policy(mut self, p: WaitPolicy) -> Self {
        self.opts.wait = p;
        self
    }

    /// All options at once.
    pub fn options(mut self, opts: ClientOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Connects. Retries with backoff while the socket does not exist or
    /// refuses connections, up to the connect timeout.
    pub fn connect(self) -> Result<Client> {
        let paths = match &self.dir {
            Some(dir) => ServerPaths::in_dir(&self.name, dir)?,
            None => ServerPaths::new(&self.name)?,
        };
        connect::connect(&paths, &self.opts)
    }
}

/// What a dropped handle leaves for its client to send.
pub(crate) enum Release {
    /// RELEASE_JOB, once the job is terminal.
    Job(JobId),
    /// END_SESSION for the lease, then RELEASE_JOB for its lookup job.
    Lease(JobId),
    /// Unregister the registration with this key.
    Unregister(u64),
}

/// The queue a client shares with its handles. `pending` lets the client's
/// every request skip the lock while nothing was queued.
#[derive(Default)]
pub(crate) struct Releases {
    queue: Mutex<Vec<Release>>,
    pending: AtomicBool,
}

impl Releases {
    pub fn push(&self, r: Release) {
        // A poisoned lock only means a thread panicked while pushing: the
        // vector is still whole.
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        // Set after the push (pairs with the Acquire swap in `take`): a
        // `take` that sees it finds the release in the queue.
        self.pending.store(true, Ordering::Release);
    }

    fn take(&self) -> Vec<Release> {
        // A plain load first: the common case (nothing queued) costs no
        // read-modify-write on the request path. Acquire (both): pairs with
        // the Release store in `push`. A push that sets the flag after the
        // swap is taken by the next call.
        if !self.pending.load(Ordering::Acquire) || !self.pending.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A connection to a kvring server.
///
/// # Examples
///
/// Start a server in this process, connect, and make a round trip:
///
/// ```
/// use kvring::{Client};
/// use kvring_server::ServerConfig;
/// use std::time::{Duration, Instant};
///
/// let name = format!("doc-client-{}", std::process::id());
/// let dir = std::env::temp_dir().join(&name);
/// let mut cfg = ServerConfig::new(&name);
/// cfg.runtime_dir = dir.clone();
/// cfg.cache.pool_bytes = 8 << 20;
/// cfg.copy.backend = kvring_server::BackendChoice::Host;
/// let server = kvring_server::start(cfg)?;
///
/// let mut client = Client::builder(&name)
///     .runtime_dir(&dir)
///     .call_timeout(Duration::from_secs(5))
///     .connect()?;
/// let deadline = Instant::now() + Duration::from_secs(5);
/// assert_eq!(client.ping(b"hello", deadline)?, b"hello");
/// assert_eq!(client.server_config()?.chunk_tokens, 256);
///
/// client.close();
/// server.stop();
/// std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Client {
    // The rings point into `link.seg`: declared (so dropped) before `link`.
    req: Producer,
    cq: Consumer,
    /// Completion bytes not reserved by any in-flight request.
    credits: usize,
    inflight: VecDeque<channel::InFlight>,
    /// How many of `inflight` are abandoned (kept so no wait scans them).
    abandoned: usize,
    /// The job-words entry of the STORE or RETRIEVE call being made (kept
    /// with the call if it is abandoned).
    call_word: Option<(u32, u32)>,
    buf: Vec<u64>,
    link: Arc<Link>,
    /// Where the server is and how to connect, for [`Client::reconnect`].
    paths: ServerPaths,
    opts: ClientOptions,
    /// Every KV cache registered and not unregistered, to register again
    /// after a reconnect.
    registrations: Vec<reconnect::Saved>,
    /// Jobs to release once they finish: those of abandoned calls and of
    /// dropped handles.
    orphans: Vec<JobId>,
    /// Leases to end once their lookup job has finished (the lease exists
    /// only then: a lookup waiting on the second tier has none yet), then
    /// their jobs to release.
    lease_ends: Vec<JobId>,
    /// What dropped handles left to send; survives a reconnect.
    releases: Arc<Releases>,
    /// Registration replies still owed by the server for requests whose
    /// wait timed out: the socket answers in order, so the next this many
    /// replies are theirs, never the answer to a later request.
    late_boot_replies: u32,
}

impl Client {
    /// Connects to server `name` in the default runtime directory, with the
    /// default options.
    pub fn connect(name: &str) -> Result<Client> {
        Self::builder(name).connect()
    }

    /// Connection settings for server `name`; `.connect()` connects.
    pub fn builder(name: &str) -> ClientBuilder {
        ClientBuilder {
            name: name.to_string(),
            dir: None,
            opts: ClientOptions::default(),
        }
    }

    /// The ring level of this connection.
    #[inline]
    pub fn raw(&mut self) -> RawChannel<'_> {
        RawChannel { c: self }
    }

    /// The slot the server assigned.
    pub fn slot(&self) -> u32 {
        self.link.slot
    }

    /// The server instance's epoch.
    pub fn epoch(&self) -> u64 {
        self.link.epoch
    }

    /// The server name.
    pub fn name(&self) -> &str {
        &self.paths.name
    }

    /// The options this client was connected with.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// Changes how long synchronous requests wait for their answer, from
    /// now on (the builder sets it at connect time).
    pub fn set_call_timeout(&mut self, timeout: Duration) {
        self.opts.call_timeout = timeout;
    }

    /// The segment as this client maps it.
    pub fn segment(&self) -> &ClientSegment {
        &self.link.seg
    }

    /// The server's process id.
    pub fn server_pid(&self) -> u32 {
        self.link.seg.mapping.info().server_pid
    }

    /// Whether the server has gone (its end of the connection closed).
    pub fn server_gone(&self) -> bool {
        self.link.conn.peer_closed()
    }

    /// How long ago the server last beat: its acceptor writes the time
    /// every tick (50 ms) while it runs, so an age of several ticks is a
    /// server stopped (SIGSTOP), hung, or starved of CPU. A caller that must
    /// not wait on such a server gives its waits up on this, long before
    /// their deadlines.
    pub fn server_heartbeat_age(&self) -> Duration {
        // Relaxed: the word is a timestamp read on its own; it orders no
        // other access (its store in the acceptor is Relaxed too).
        let beat = self.link.seg.mapping.header().heartbeat_ns.load(Ordering::Relaxed);
        Duration::from_nanos(crate::liveness::monotonic_ns().saturating_sub(beat))
    }

    /// One PING round trip: the payload comes back unchanged.
    pub fn ping(&mut self, payload: &[u8], deadline: Instant) -> Result<Vec<u8>> {
        self.call(Opcode::Ping, payload, deadline)
    }

    /// The server's configuration (chunk size, pool, limits).
    pub fn server_config(&mut self) -> Result<ConfigReply> {
        let r = self.call_now(Opcode::GetConfig, &[])?;
        reply_struct(&r)
    }

    /// Drops every stored object not leased or being written.
    pub fn clear(&mut self) -> Result<ClearReply> {
        let r = self.call_now(Opcode::Clear, &[])?;
        reply_struct(&r)
    }

    /// The cache's counters.
    pub fn stats(&mut self) -> Result<StatsReply> {
        let r = self.call_now(Opcode::Stats, &[])?;
        reply_struct(&r)
    }

    /// Sends what dropped handles left queued: leases ended, registrations
    /// unregistered, and the jobs released that have finished (the others
    /// stay queued until they do). Runs before every synchronous request.
    /// Ring requests (END_SESSION, RELEASE_JOB) are posted: written ahead
    /// of the caller's request and never waited for (their completions are
    /// dropped as they arrive, like an abandoned call's), so the caller's
    /// deadline pays no round trip for them; what finds no room in the
    /// rings stays queued for the next time. A failure of the server to
    /// release something leaves it to its cleanup when this client
    /// disconnects.
    pub(super) fn send_releases(&mut self) {
        let queued = self.releases.take();
        if queued.is_empty() && self.orphans.is_empty() && self.lease_ends.is_empty() {
            return;
        }
        let epoch = self.link.epoch;
        let mut posted = false;
        for r in queued {
            match r {
                // Jobs of an earlier server are gone with it.
                Release::Job(id) if id.epoch == epoch => self.orphans.push(id),
                Release::Lease(id) if id.epoch == epoch => self.lease_ends.push(id),
                Release::Unregister(key) => {
                    let _ = self.unregister_key(key);
                }
                _ => {}
            }
        }
        let ends = std::mem::take(&mut self.lease_ends);
        for id in ends {
            match self.job_status(id) {
                Ok(s) if s.is_terminal() => {
                    let h = crate::proto::kv::EndSessionRequest { lease: id };
                    if self
                        .post(Opcode::EndSession, bytemuck::bytes_of(&h))
                        .is_err()
                    {
                        self.lease_ends.push(id);
                        continue;
                    }
                    posted = true;
                    // Its lookup job: released after the END_SESSION (the
                    // ring keeps the order), below.
                    self.orphans.push(id);
                }
                Ok(_) => self.lease_ends.push(id),
                // Not a job of this server any more.
                Err(_) => {}
            }
        }
        let orphans = std::mem::take(&mut self.orphans);
        for id in orphans {
            match self.job_status(id) {
                Ok(s) if s.is_terminal() => {
                    if self
                        .post(Opcode::ReleaseJob, bytemuck::bytes_of(&id))
                        .is_err()
                    {
                        self.orphans.push(id);
                    } else {
                        posted = true;
                    }
                }
                Ok(_) => self.orphans.push(id),
                Err(_) => {}
            }
        }
        if posted {
            self.flush();
        }
    }

    /// Ends the session cleanly: the server frees the slot at once, and
    /// with it every job, lease and registration of this connection.
    pub fn close(self) {
        drop(self);
    }
}

pub(crate) fn reply_struct<T: bytemuck::Pod>(r: &[u8]) -> Result<T> {
    if r.len() != std::mem::size_of::<T>() {
        return Err(Error::Protocol(format!(
            "reply of {} bytes, expected {}",
            r.len(),
            std::mem::size_of::<T>()
        )));
    }
    Ok(bytemuck::pod_read_unaligned(r))
}

impl Drop for Client {
    fn drop(&mut self) {
        // The goodbye tells the server it may reuse the slot immediately and
        // reclaim what the connection held; the rings are unmapped once the
        // last handle sharing the link is gone.
        let g = Goodbye::default();
        self.link.close();
        let _ = self.link.conn.send(bytemuck::bytes_of(&g), &[]);
    }
}

// Handles move to the threads that wait on them; the client moves between
// threads too (one at a time).
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    const fn send<T: Send>() {}
    send_sync::<Job>();
    send_sync::<Lease>();
    send_sync::<Registration>();
    send::<Client>();
};
