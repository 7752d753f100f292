//! Leases: what a LOOKUP holds. The lookup finds how many leading chunks of
//! a prompt are stored for every rank and holds them against eviction; each
//! rank's RETRIEVE takes its holds, and ending the lease (END_SESSION on the
//! wire) frees what is left and marks the chunks recently used.

use super::connect::Link;
use super::{jobs, Client, Job, Release, Releases};
use crate::error::{Error, Result};
use crate::jobs::{JobId, JobResult};
use crate::kv::ChunkHash;
use crate::proto::kv::{EndSessionRequest, FreeLocksRequest, LookupRequest};
use crate::proto::{Opcode, Status};
use std::sync::Arc;
use std::time::Instant;

/// A lease's name: the id of the lookup job that took it. Plain data, to
/// hand to the worker processes whose retrieves use the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(JobId);

impl LeaseId {
    /// The lease taken by lookup job `id`.
    pub fn from_job(id: JobId) -> LeaseId {
        LeaseId(id)
    }

    /// The lookup job's id.
    pub fn job(self) -> JobId {
        self.0
    }

    /// 16 bytes, as on the wire.
    pub fn to_bytes(self) -> [u8; 16] {
        bytemuck::cast(self.0)
    }

    pub fn from_bytes(bytes: [u8; 16]) -> LeaseId {
        LeaseId(bytemuck::cast(bytes))
    }
}

impl From<&Lease> for LeaseId {
    fn from(l: &Lease) -> LeaseId {
        l.id
    }
}

/// A LOOKUP request: the leading chunks of `hashes` stored for every rank
/// of `world_size`.
///
/// # Examples
///
/// ```
/// use kvring::kv::{chunk_hashes, model_id, salt_id};
/// use kvring::Lookup;
///
/// let tokens: Vec<u32> = (0..512).collect();
/// let hashes = chunk_hashes(&tokens, 256);
/// let req = Lookup::new(model_id("llama-3-8b"), 2, &hashes).salt(salt_id(Some("tenant-a")));
/// # let _ = req;
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a request does nothing until submitted with Client::lookup"]
pub struct Lookup<'a> {
    model_id: u64,
    world_size: u32,
    hashes: &'a [ChunkHash],
    salt: u64,
}

impl<'a> Lookup<'a> {
    pub fn new(model_id: u64, world_size: u32, hashes: &'a [ChunkHash]) -> Lookup<'a> {
        Lookup {
            model_id,
            world_size,
            hashes,
            salt: 0,
        }
    }

    /// The cache salt (`kv::salt_id`) the chunks were stored with.
    pub fn salt(mut self, salt: u64) -> Self {
        self.salt = salt;
        self
    }
}

/// The holds a LOOKUP took: the first [`Lease::hits`] chunks, held for every
/// rank against eviction until a retrieve of that rank takes them, the lease
/// ends, or the server's lease TTL passes.
///
/// Dropping a `Lease` ends it: END_SESSION (which frees the holds no
/// retrieve took) and the release of its lookup job are queued with the
/// client and sent with its next synchronous request; if the client closes
/// first, the server ends the lease with the connection.
/// [`Client::end_lease`] ends it now. [`Lease::into_id`] detaches it: the
/// workers' retrieves and the TTL end it then (or
/// [`Client::end_lease_id`]).
///
/// A lookup is answered inline, so `hits` is known when the lease is.
///
/// # Examples
///
/// ```
/// # use kvring::kv::{chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
/// # use kvring::{Client, HostKvCache, KvSpec};
/// # use kvring_server::ServerConfig;
/// # use std::time::{Duration, Instant};
/// # let name = format!("doc-lease-{}", std::process::id());
/// # let dir = std::env::temp_dir().join(&name);
/// # let mut cfg = ServerConfig::new(&name);
/// # cfg.runtime_dir = dir.clone();
/// # cfg.cache.pool_bytes = 8 << 20;
/// # cfg.copy.backend = kvring_server::BackendChoice::Host;
/// # let server = kvring_server::start(cfg)?;
/// # let mut client = Client::builder(&name).runtime_dir(&dir).connect()?;
/// # let shape = KvShape { layers: 2, blocks: 64, block_tokens: 16, heads: 2, head_dim: 32 };
/// # let layout = KvLayout::preset(LayoutPreset::Lbnhc, KvGeometry::mha(shape, Dtype::Bf16))?;
/// # let cache = HostKvCache::new(layout, 256)?;
/// # let deadline = Instant::now() + Duration::from_secs(10);
/// use kvring::{LeaseId, Lookup};
///
/// let hashes = chunk_hashes(&(0..512).collect::<Vec<u32>>(), 256);
/// let lease = client.lookup(Lookup::new(model_id("doc-model"), 1, &hashes))?;
/// assert_eq!(lease.hits(), 0); // nothing stored yet
/// // Workers in other processes get the id as 16 bytes.
/// let id = lease.id();
/// assert_eq!(LeaseId::from_bytes(id.to_bytes()), id);
/// client.end_lease(lease)?; // or drop it: ended with the next request
/// # client.close();
/// # server.stop();
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a Lease ends it (its holds are freed)"]
pub struct Lease {
    id: LeaseId,
    result: JobResult,
    link: Arc<Link>,
    releases: Arc<Releases>,
    detached: bool,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("hits", &self.hits())
            .finish()
    }
}

impl Lease {
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// Leading chunks found for every rank (and held).
    pub fn hits(&self) -> u64 {
        self.result.value
    }

    /// The lookup job's whole result: `value` is the hits, `aux` the number
    /// of chunks asked for.
    pub fn result(&self) -> JobResult {
        self.result
    }

    /// Whether the server this lease was taken on is still there.
    pub fn server_gone(&self) -> bool {
        self.link.conn.peer_closed()
    }

    /// Detaches the id: nothing is ended or released when the handle goes.
    pub fn into_id(mut self) -> LeaseId {
        self.detached = true;
        self.id
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.detached {
            self.releases.push(Release::Lease(self.id.0));
        }
    }
}

/// A LOOKUP submitted and not answered yet (its chunks are being read from
/// the second tier, or the server has not got to it): its owner polls it
/// with [`Client::poll_lookup`] and never waits longer than it chooses.
///
/// Dropping it ends the lease the lookup takes, once the lookup finishes
/// (queued with the client, as a dropped [`Lease`] is).
#[must_use = "dropping a PendingLookup ends its lease once it is answered"]
pub struct PendingLookup {
    id: LeaseId,
    releases: Arc<Releases>,
    detached: bool,
}

impl std::fmt::Debug for PendingLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingLookup").field("id", &self.id).finish()
    }
}

impl PendingLookup {
    pub fn id(&self) -> LeaseId {
        self.id
    }
}

impl Drop for PendingLookup {
    fn drop(&mut self) {
        if !self.detached {
            self.releases.push(Release::Lease(self.id.0));
        }
    }
}

/// What [`Client::poll_lookup`] found.
#[derive(Debug)]
pub enum LookupPoll {
    /// Answered: the lease on the hit chunks.
    Ready(Lease),
    /// Not answered by the deadline: poll again later.
    Pending(PendingLookup),
}

impl Client {
    /// LOOKUP: how many leading chunks of the prompt are stored for every
    /// rank, held (for RETRIEVE) by the returned lease. Waits for the answer
    /// up to the call timeout (chunks only the second tier has are read
    /// into the pool first); [`Client::submit_lookup`] does not wait.
    pub fn lookup(&mut self, req: Lookup<'_>) -> Result<Lease> {
        let deadline = Instant::now() + self.opts.call_timeout;
        let pending = self.submit_lookup(req, deadline)?;
        match self.poll_lookup(pending, deadline)? {
            LookupPoll::Ready(lease) => Ok(lease),
            // The lookup stays pending: its lease is ended once it ends.
            LookupPoll::Pending(_) => Err(Error::Timeout(self.opts.call_timeout)),
        }
    }

    /// Submits a LOOKUP, waiting until `deadline` at most for the server to
    /// take it (not for its answer: see [`Client::poll_lookup`]). A server
    /// that does not take it by then (stopped, or wedged) fails the call
    /// with `Timeout`; if it takes it later, the lease it makes is ended.
    pub fn submit_lookup(&mut self, req: Lookup<'_>, deadline: Instant) -> Result<PendingLookup> {
        let h = LookupRequest {
            model_id: req.model_id,
            salt: req.salt,
            world_size: req.world_size,
            n_chunks: req.hashes.len() as u32,
        };
        let mut payload = bytemuck::bytes_of(&h).to_vec();
        payload.extend_from_slice(&req.hashes.concat());
        let reply = self.call_large(Opcode::Lookup, &payload, deadline)?;
        let job = self.job_reply(&reply)?;
        // From here the job is a lease: if it is dropped unanswered, or its
        // wait or outcome fails, a lookup that completes later still holds
        // chunks, so its end (not only its release) is queued.
        Ok(PendingLookup {
            id: LeaseId(job.into_id()),
            releases: self.releases.clone(),
            detached: false,
        })
    }

    /// The lease of `pending` if the server has answered it by `deadline`
    /// (now, for a poll that does not wait), else `pending` back.
    pub fn poll_lookup(&mut self, mut pending: PendingLookup, deadline: Instant) -> Result<LookupPoll> {
        let id = pending.id;
        let st = match jobs::wait_job(&self.link, id.0, deadline) {
            Ok(st) => st,
            Err(Error::Timeout(_)) => return Ok(LookupPoll::Pending(pending)),
            // Dropped: its end is queued.
            Err(e) => return Err(e),
        };
        let result = jobs::outcome(st)?;
        pending.detached = true;
        Ok(LookupPoll::Ready(Lease {
            id,
            result,
            link: self.link.clone(),
            releases: self.releases.clone(),
            detached: false,
        }))
    }

    /// Frees the lease's holds on chunks `first_chunk .. first_chunk + n`
    /// (`u32::MAX`: to the end), for chunks that will not be retrieved
    /// (FREE_LOOKUP_LOCKS on the wire).
    pub fn release_lease_chunks(
        &mut self,
        lease: impl Into<LeaseId>,
        first_chunk: u32,
        n: u32,
    ) -> Result<()> {
        let h = free_locks(lease.into(), first_chunk, n);
        self.call_now(Opcode::FreeLookupLocks, bytemuck::bytes_of(&h))?;
        Ok(())
    }

    /// FREE_LOOKUP_LOCKS, posted: as [`Client::release_lease_chunks`], but
    /// written to the ring and never waited for (its completion is dropped
    /// when it arrives), so a stopped server costs the caller nothing. A
    /// ring without room refuses it (`Error::Ring`); the holds then go with
    /// the lease's end.
    pub fn post_release_lease_chunks(
        &mut self,
        lease: impl Into<LeaseId>,
        first_chunk: u32,
        n: u32,
    ) -> Result<()> {
        let h = free_locks(lease.into(), first_chunk, n);
        let r = self.post(Opcode::FreeLookupLocks, bytemuck::bytes_of(&h));
        self.flush();
        r
    }

    /// Ends a lease without waiting for the server, for a caller that
    /// cannot afford a round trip (a scheduler's step): its END_SESSION and
    /// the release of its lookup job are posted, never waited for. What
    /// finds no room in the rings stays queued and goes ahead of this
    /// client's next request. A server that never reads them frees the
    /// holds when this client disconnects, or when the lease's TTL ends.
    /// (Registrations dropped earlier and still queued are unregistered
    /// here too, and those are calls: a client that must never wait keeps
    /// its registrations elsewhere, as the vLLM scheduler has none.)
    pub fn post_end_lease(&mut self, lease: Lease) {
        drop(lease);
        self.send_releases();
    }

    /// Ends a lease now (the request is over): frees what it still holds,
    /// marks its chunks recently used, and releases its lookup job. A lease
    /// whose holds the retrieves took, every one, has ended already: that
    /// is not an error here.
    ///
    /// On an error the lease is dropped, which queues its end again, so its
    /// holds are not left to the TTL.
    pub fn end_lease(&mut self, lease: Lease) -> Result<()> {
        let id = lease.id();
        match self.send_end_lease(id) {
            Ok(()) | Err(Error::Status(Status::NoLease)) => {}
            Err(e) => return Err(e),
        }
        // Ended: what is left is its lookup job, released now or, on an
        // error, by the dropped handle.
        let job = Job::new(id.0, self.link.clone(), self.releases.clone());
        let _ = lease.into_id();
        self.release_job(job)
    }

    /// Ends a lease known by id (one detached, or taken by another process):
    /// END_SESSION only; its lookup job belongs to whoever took it.
    pub fn end_lease_id(&mut self, id: LeaseId) -> Result<()> {
        self.send_end_lease(id)
    }

    pub(super) fn send_end_lease(&mut self, id: LeaseId) -> Result<()> {
        let h = EndSessionRequest { lease: id.0 };
        self.call_now(Opcode::EndSession, bytemuck::bytes_of(&h))?;
        Ok(())
    }
}

/// FREE_LOOKUP_LOCKS' request: chunks `first_chunk .. first_chunk + n` of
/// `lease`.
fn free_locks(lease: LeaseId, first_chunk: u32, n: u32) -> FreeLocksRequest {
    FreeLocksRequest {
        lease: lease.0,
        first_chunk,
        n_chunks: n,
    }
}
