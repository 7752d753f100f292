//! The engine's copy jobs on a registered cache: STORE and RETRIEVE (from
//! each worker), built with [`Store`] and [`Retrieve`].
//!
//! A request larger than one ring frame (a long prompt's hashes, a large
//! block list) is sent as several frames and answered once.

use crate::device::IpcEventHandle;
use super::lease::LeaseId;
use super::channel::payload;
use super::{Client, Job};
use super::registration::Registration;
use crate::error::{Error, Result};
use crate::kv::ChunkHash;
use crate::proto::kv::{DescribeRequest, KvFlags, RetrieveRequest, StoreRequest};
use crate::proto::Opcode;
use std::time::{Duration, Instant};

/// A STORE request: copy the blocks of each chunk (`blocks_per_chunk` ids
/// each, the last chunk 1 to `blocks_per_chunk`) into the pool. A short last
/// chunk is a prompt's tail: its object's rows past its blocks are zeros.
/// The job's result value is the chunks present after it; aux, the chunks
/// that got no space.
///
/// # Examples
///
/// ```
/// # use kvring::kv::{chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
/// # use kvring::{Client, HostKvCache, KvSpec};
/// # use kvring_server::ServerConfig;
/// # use std::time::{Duration, Instant};
/// # let name = format!("doc-store-{}", std::process::id());
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
/// use kvring::jobs::JobStatus;
/// use kvring::kv::salt_id;
/// use kvring::{Lookup, Store};
///
/// let reg = client.register_host(&KvSpec::new(model_id("doc-model"), 1, 0), &cache)?;
/// let tokens: Vec<u32> = (0..512).collect();
/// let hashes = chunk_hashes(&tokens, reg.chunk_tokens()); // 2 chunks
/// let blocks: Vec<u32> = (0..2 * reg.blocks_per_chunk()).collect();
/// let salt = salt_id(Some("tenant-a"));
/// // (A GPU engine adds `.after(event.handle())`: the copies wait for its event.)
/// let job = client.store(Store::new(&reg, &hashes, &blocks).salt(salt))?;
/// match job.wait(deadline)? {
///     JobStatus::Done(r) => assert_eq!((r.value, r.aux), (2, 0)), // present, no space
///     other => panic!("{other:?}"),
/// }
/// let lease = client.lookup(Lookup::new(model_id("doc-model"), 1, &hashes).salt(salt))?;
/// assert_eq!(lease.hits(), 2);
/// # client.close();
/// # server.stop();
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a request does nothing until submitted with Client::store"]
pub struct Store<'a> {
    reg: &'a Registration,
    hashes: &'a [ChunkHash],
    blocks: &'a [u32],
    salt: u64,
    after: Option<IpcEventHandle>,
    timeout: Duration,
    submit_within: Option<Duration>,
}

/// How long a STORE or RETRIEVE may run before its client gives it up
/// (see [`Store::timeout`]).
pub const DEFAULT_JOB_TIMEOUT: Duration = Duration::from_secs(60);

impl<'a> Store<'a> {
    pub fn new(reg: &'a Registration, hashes: &'a [ChunkHash], blocks: &'a [u32]) -> Store<'a> {
        Store {
            reg,
            hashes,
            blocks,
            salt: 0,
            after: None,
            timeout: DEFAULT_JOB_TIMEOUT,
            submit_within: None,
        }
    }

    /// How long the submission may wait for the server to take the job
    /// (default: the client's call timeout). A server that does not answer
    /// in time (stopped, not dead) fails it with `ServerTimeout`: a caller
    /// on an engine's step bounds what such a server costs it.
    pub fn submit_within(mut self, t: Duration) -> Self {
        self.submit_within = Some(t);
        self
    }

    /// How long the job may run (default [`DEFAULT_JOB_TIMEOUT`]): past it
    /// the client gives it up (when a wait on it or a stream ordered after
    /// it sees the deadline pass): no copy starts afterwards, one under way
    /// is waited for, the store does not commit, and the wait reports
    /// `Timeout`; the blocks are the engine's again.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// The cache salt (`kv::salt_id`) to store the chunks under.
    pub fn salt(mut self, salt: u64) -> Self {
        self.salt = salt;
        self
    }

    /// The copies come after the CUDA IPC event the engine recorded after
    /// writing the blocks: the server polls it from the host and queues them
    /// once it completed (no server stream waits on it); past the server's
    /// engine-event timeout (default 60 s) the job fails
    /// `EngineEventTimeout` (chunks not copied by then never are). The
    /// server sees only the event's last record: do not record it again
    /// before this job has left `Pending`.
    pub fn after(mut self, event: IpcEventHandle) -> Self {
        self.after = Some(event);
        self
    }
}

/// A RETRIEVE request: copy chunks `first_chunk ..` of a lease into `blocks`
/// (`blocks_per_chunk` ids a chunk, the last chunk 1 to `blocks_per_chunk`:
/// the first rows of its object, a tail a short STORE stored, say). All or
/// nothing: fails at once with
/// `NoLease` unless the lease holds every chunk for this rank; it consumes
/// the lease's holds for this rank.
///
/// The lease is a [`super::Lease`] of this process (`&lease`) or a
/// [`LeaseId`] received from the scheduler.
///
/// # Examples
///
/// ```
/// # use kvring::kv::{chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
/// # use kvring::{Client, HostKvCache, KvSpec};
/// # use kvring_server::ServerConfig;
/// # use std::time::{Duration, Instant};
/// # let name = format!("doc-retrieve-{}", std::process::id());
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
/// use kvring::jobs::JobStatus;
/// use kvring::{Lookup, Retrieve, Store};
///
/// let reg = client.register_host(&KvSpec::new(model_id("doc-model"), 1, 0), &cache)?;
/// let bpc = reg.blocks_per_chunk();
/// let hashes = chunk_hashes(&(0..768).collect::<Vec<u32>>(), 256); // 3 chunks
/// let stored: Vec<u32> = (0..3 * bpc).collect();
/// for (h, b) in hashes.iter().zip(stored.chunks(bpc as usize)) {
///     pattern::write_chunk(&cache, 0, h, b);
/// }
/// let job = client.store(Store::new(&reg, &hashes, &stored))?;
/// assert!(matches!(job.wait(deadline)?, JobStatus::Done(_)));
///
/// let lease = client.lookup(Lookup::new(model_id("doc-model"), 1, &hashes))?;
/// assert_eq!(lease.hits(), 3);
/// // Chunks 1 and 2 of the lease into other blocks, leaving the first 16
/// // tokens (one block) untouched: the engine still has them.
/// cache.fill(0xa5);
/// let fresh: Vec<u32> = (32..32 + 2 * bpc).collect();
/// let job = client.retrieve(Retrieve::new(&reg, &lease, &fresh).first_chunk(1).skip_tokens(16))?;
/// assert!(matches!(job.wait(deadline)?, JobStatus::Done(_)));
/// for (i, (h, b)) in hashes[1..].iter().zip(fresh.chunks(bpc as usize)).enumerate() {
///     let skip_blocks = if i == 0 { 1 } else { 0 };
///     pattern::verify_chunk(&cache, 0, h, b, skip_blocks, 0xa5)?;
/// }
/// # client.close();
/// # server.stop();
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use = "a request does nothing until submitted with Client::retrieve"]
pub struct Retrieve<'a> {
    reg: &'a Registration,
    lease: LeaseId,
    blocks: &'a [u32],
    first_chunk: u32,
    skip_tokens: u32,
    layer_groups: u32,
    after: Option<IpcEventHandle>,
    timeout: Duration,
    submit_within: Option<Duration>,
}

impl<'a> Retrieve<'a> {
    pub fn new(
        reg: &'a Registration,
        lease: impl Into<LeaseId>,
        blocks: &'a [u32],
    ) -> Retrieve<'a> {
        Retrieve {
            reg,
            lease: lease.into(),
            blocks,
            first_chunk: 0,
            skip_tokens: 0,
            layer_groups: 1,
            after: None,
            timeout: DEFAULT_JOB_TIMEOUT,
            submit_within: None,
        }
    }

    /// How long the submission may wait for the server to take the job (as
    /// [`Store::submit_within`]).
    pub fn submit_within(mut self, t: Duration) -> Self {
        self.submit_within = Some(t);
        self
    }

    /// Lands the layers in `n` groups ([`crate::kv::LayerGroups`], 1 to the
    /// layer count; default 1), one after another: the engine reads a layer
    /// once its group landed ([`Job::wait_layer_group`], or on a GPU
    /// `EngineStream::wait_layer_group`) while later groups are copied.
    pub fn layer_groups(mut self, n: u32) -> Self {
        self.layer_groups = n;
        self
    }

    /// How long the job may run before its client gives it up (as
    /// [`Store::timeout`]): no copy lands in the blocks afterwards.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// The first chunk of the lease to copy (default 0).
    pub fn first_chunk(mut self, i: u32) -> Self {
        self.first_chunk = i;
        self
    }

    /// Leaves the first `n` tokens (a multiple of the block size) untouched.
    pub fn skip_tokens(mut self, n: u32) -> Self {
        self.skip_tokens = n;
        self
    }

    /// The copies come after the CUDA IPC event the engine recorded once it
    /// stopped using the blocks (polled by the server from the host, as for
    /// [`Store::after`]).
    pub fn after(mut self, event: IpcEventHandle) -> Self {
        self.after = Some(event);
        self
    }
}

impl Client {
    /// STORE: a job copying the blocks into the pool (see [`Store`]).
    pub fn store(&mut self, req: Store<'_>) -> Result<Job> {
        let reg = req.reg;
        let bpc = reg.blocks_per_chunk() as usize;
        let n = req.hashes.len();
        let fits = match n {
            0 => req.blocks.is_empty(),
            n => req.blocks.len() > (n - 1) * bpc && req.blocks.len() <= n * bpc,
        };
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "{} block ids for {n} chunks: need {bpc} a chunk, the last chunk 1 to {bpc}",
                req.blocks.len(),
            )));
        }
        let h = StoreRequest {
            instance: self.server_instance(reg)?,
            n_chunks: req.hashes.len() as u32,
            salt: req.salt,
            flags: if req.after.is_some() {
                KvFlags::EVENT.bits()
            } else {
                0
            },
            word: 0,
            generation: 0,
            _reserved: 0,
            event: req.after.map_or([0; 64], IpcEventHandle::to_bytes),
        };
        self.submit_copy_job(Opcode::Store, req.timeout, req.submit_within, 1, |word, generation| {
            let h = StoreRequest {
                word,
                generation,
                ..h
            };
            payload(
                &h,
                &[
                    req.hashes.concat().as_slice(),
                    bytemuck::cast_slice(req.blocks),
                ],
            )
        })
    }

    /// Submits a STORE or RETRIEVE (in `groups` layer groups) with an entry
    /// of the job words (its payload made by `build` for that entry and
    /// generation), waiting `submit_within` (else the call timeout) for the
    /// server to take it.
    fn submit_copy_job(
        &mut self,
        op: Opcode,
        timeout: Duration,
        submit_within: Option<Duration>,
        groups: u32,
        build: impl FnOnce(u32, u32) -> Vec<u8>,
    ) -> Result<Job> {
        // Refused before anything is sent, so no entry is taken for it.
        self.check_no_call_in_flight(op)?;
        let (entry, g) = self.link.words.take(&self.link, timeout, groups)?;
        self.call_word = Some((entry, g));
        let deadline = Instant::now() + submit_within.unwrap_or(self.opts.call_timeout);
        let r = self.submit_job_by(op, &build(entry, g), deadline);
        self.call_word = None;
        match r {
            Ok(job) => {
                self.link.words.bind(entry, job.id());
                Ok(job.with_word(entry, g, groups))
            }
            // Refused, or never sent: nothing of it ran.
            Err(
                e @ (Error::Status(_)
                | Error::UnknownStatus(_)
                | Error::CallInFlight { .. }
                | Error::Ring(_)),
            ) => {
                self.link.words.put_back(entry);
                Err(e)
            }
            // No answer yet (the call timed out: the entry is bound to the
            // job if a late answer names one), or none will come: the
            // server may still run it.
            Err(e) => {
                self.link.words.abandon(&self.link, entry, g);
                Err(e)
            }
        }
    }

    /// RETRIEVE: a job copying chunks of a lease into blocks (see
    /// [`Retrieve`]).
    pub fn retrieve(&mut self, req: Retrieve<'_>) -> Result<Job> {
        let bpc = req.reg.blocks_per_chunk() as usize;
        if req.blocks.is_empty() {
            return Err(Error::InvalidArgument(
                "no block ids: a retrieve writes at least one block".into(),
            ));
        }
        let layers = req.reg.layout.geometry().layers;
        if crate::kv::LayerGroups::new(layers, req.layer_groups).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{} layer groups: need 1 to {layers} (the layer count)",
                req.layer_groups
            )));
        }
        let mut flags = KvFlags::empty();
        flags.set(KvFlags::EVENT, req.after.is_some());
        let h = RetrieveRequest {
            lease: req.lease.job(),
            instance: self.server_instance(req.reg)?,
            first_chunk: req.first_chunk,
            n_chunks: req.blocks.len().div_ceil(bpc) as u32,
            skip_tokens: req.skip_tokens,
            flags: flags.bits(),
            word: 0,
            generation: 0,
            layer_groups: req.layer_groups,
            event: req.after.map_or([0; 64], IpcEventHandle::to_bytes),
        };
        let groups = req.layer_groups;
        self.submit_copy_job(Opcode::Retrieve, req.timeout, req.submit_within, groups, |word, generation| {
            let h = RetrieveRequest {
                word,
                generation,
                ..h
            };
            payload(&h, &[bytemuck::cast_slice(req.blocks)])
        })
    }
}

impl Client {
    /// DESCRIBE: tells a server that publishes KV events
    /// ([`ConfigFlags::EVENTS`](crate::proto::kv::ConfigFlags) in
    /// [`Client::server_config`]) the token ids of chunks `first_chunk ..`
    /// of a prompt, ahead of their stores, so that its events carry them.
    /// `tokens` is the prompt from its start (the chunks before
    /// `first_chunk` continue the hash chain); its whole chunks from
    /// `first_chunk` on are described. `chunk_tokens` must be the server's.
    ///
    /// Posted, never waited for: each request (as many chunks as one ring
    /// frame holds) is written to the ring and its completion dropped when
    /// it arrives, so a stopped server costs the caller nothing. A ring
    /// without room refuses the rest (`Error::Ring`); the server's events
    /// then go without those token ids. A server without events ignores
    /// them.
    pub fn describe(
        &mut self,
        model_id: u64,
        salt: u64,
        chunk_tokens: u32,
        tokens: &[u32],
        first_chunk: usize,
    ) -> Result<()> {
        if chunk_tokens == 0 {
            return Err(Error::InvalidArgument("chunk_tokens is 0".into()));
        }
        let ct = chunk_tokens as usize;
        let whole = tokens.len() / ct;
        if first_chunk > whole {
            return Err(Error::InvalidArgument(format!(
                "chunk {first_chunk} of a prompt of {whole} whole chunks"
            )));
        }
        let room = self.req.max_payload() - std::mem::size_of::<DescribeRequest>();
        let per = room / (ct * 4);
        if per == 0 {
            return Err(Error::InvalidArgument(format!(
                "a chunk of {chunk_tokens} tokens does not fit one ring frame ({room} bytes)"
            )));
        }
        let seed = crate::kv::chain_seed();
        let (_, mut prev) = crate::kv::chunk_chain(seed, &tokens[..first_chunk * ct], chunk_tokens);
        let r = tokens[first_chunk * ct..whole * ct]
            .chunks(per * ct)
            .try_for_each(|piece| {
                let h = DescribeRequest {
                    model_id,
                    salt,
                    prev,
                    n_chunks: (piece.len() / ct) as u32,
                    _reserved: 0,
                };
                self.post(
                    Opcode::Describe,
                    &payload(&h, &[bytemuck::cast_slice(piece)]),
                )?;
                prev = crate::kv::chunk_chain(prev, piece, chunk_tokens).1;
                Ok(())
            });
        self.flush();
        r
    }
}
