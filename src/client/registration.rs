//! Registering an engine's KV cache: who registers it ([`KvSpec`]), the
//! memory it lives in ([`Memory`]), and the registration the server keeps
//! until it is dropped or unregistered ([`Registration`]).

use crate::device::DeviceUuid;
use super::{reconnect::Saved, Client, Release, Releases};
use super::channel::payload;
use crate::error::{Error, Result};
use crate::kv::KvLayout;
use crate::proto::kv::{
    KvAllocation, MemKind, MemoryPiece, RegisterKv, RegisterReply, RegisterTables, UnregisterKv,
};
use crate::proto::{BootKind, BOOT_MAGIC};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

/// Who registers a KV cache: the model, the tensor-parallel world and this
/// worker's rank in it, and (optionally) the GPU the worker runs on.
///
/// # Examples
///
/// ```
/// use kvring::kv::model_id;
/// use kvring::{DeviceUuid, KvSpec};
///
/// let spec = KvSpec::new(model_id("llama-3-8b"), 2, 1).on_device(DeviceUuid::from_bytes([7; 16]));
/// assert_eq!((spec.world_size, spec.rank), (2, 1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvSpec {
    /// `kv::model_id(name)`.
    pub model_id: u64,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// This worker's rank.
    pub rank: u32,
    /// The device of the memory (device caches), or the device the worker
    /// runs on (host caches: its copies go to that device's copy lane, next
    /// to, never behind, other devices' copies).
    pub device: Option<DeviceUuid>,
}

impl KvSpec {
    pub fn new(model_id: u64, world_size: u32, rank: u32) -> KvSpec {
        KvSpec {
            model_id,
            world_size,
            rank,
            device: None,
        }
    }

    /// See [`KvSpec::device`].
    pub fn on_device(mut self, uuid: DeviceUuid) -> Self {
        self.device = Some(uuid);
        self
    }
}

/// Where a KV cache's allocations are, for [`Client::register`]: one entry
/// per allocation of its [`KvLayout`], in order, each of the bytes the
/// layout says; the descriptors are the registration's `fds`.
///
/// # Examples
///
/// ```
/// use kvring::client::Memory;
/// use kvring::proto::kv::MemoryPiece;
///
/// // One allocation: 3 VMM chunks of 20 MiB (descriptors 0, 1 and 2),
/// // mapped one after another; the KV cache starts 4 MiB into them.
/// let chunks = [MemoryPiece { first_fd: 0, n_fds: 3, fd_offset: 0, fd_bytes: 20 << 20 }];
/// let memory = Memory::cuda_vmm([(4 << 20, &chunks[..])]);
/// assert_eq!(memory.allocations(), 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Memory {
    kind: MemKind,
    allocs: Vec<KvAllocation>,
    pieces: Vec<MemoryPiece>,
}

impl Memory {
    fn allocation(offset: u64) -> KvAllocation {
        KvAllocation {
            ipc_handle: [0; 64],
            offset,
            bytes: 0,
            first_piece: 0,
            n_pieces: 0,
        }
    }

    /// Host memory: each allocation at `offset` of memfd `fd_index`
    /// (sealed against shrinking, see [`super::HostKvCache`]).
    pub fn host(memfds: impl IntoIterator<Item = (u32, u64)>) -> Memory {
        let mut m = Memory {
            kind: MemKind::HostFd,
            allocs: Vec::new(),
            pieces: Vec::new(),
        };
        for (fd, offset) in memfds {
            let mut a = Memory::allocation(0);
            a.first_piece = m.pieces.len() as u32;
            a.n_pieces = 1;
            m.pieces.push(MemoryPiece {
                first_fd: fd,
                n_fds: 1,
                fd_offset: offset,
                // The window's size, filled from the layout.
                fd_bytes: 0,
            });
            m.allocs.push(a);
        }
        m
    }

    /// Memory in this process's own address space: each allocation at its
    /// address here (any memory: a CPU tensor, a `Vec`). The server copies
    /// it by cross-memory attach, which registering consents to (see
    /// `shm_layout.md`, "KvAllocation"). It needs no descriptor and no
    /// alignment, only anonymous or shared memory (not a file's mapping).
    /// Once [`Client::unregister`] returns (or the client closed), no copy
    /// touches it; an address unmapped under a copy fails that job, never
    /// the server.
    pub fn process(addresses: impl IntoIterator<Item = u64>) -> Memory {
        Memory {
            kind: MemKind::ProcessVm,
            allocs: addresses.into_iter().map(Memory::allocation).collect(),
            pieces: Vec::new(),
        }
    }

    /// Device memory from `cuMemAlloc`: each allocation at `offset` of
    /// the allocation whose legacy IPC handle is given.
    pub fn cuda_ipc(handles: impl IntoIterator<Item = ([u8; 64], u64)>) -> Memory {
        Memory {
            kind: MemKind::CudaIpc,
            allocs: handles
                .into_iter()
                .map(|(h, offset)| KvAllocation {
                    ipc_handle: h,
                    ..Memory::allocation(offset)
                })
                .collect(),
            pieces: Vec::new(),
        }
    }

    /// CUDA VMM memory exported as POSIX fds: each allocation at `offset`
    /// of its chunks (pieces of descriptors), which the server maps one
    /// after another.
    pub fn cuda_vmm<'p>(allocs: impl IntoIterator<Item = (u64, &'p [MemoryPiece])>) -> Memory {
        let mut m = Memory {
            kind: MemKind::CudaVmmFd,
            allocs: Vec::new(),
            pieces: Vec::new(),
        };
        for (offset, pieces) in allocs {
            let mut a = Memory::allocation(offset);
            a.first_piece = m.pieces.len() as u32;
            a.n_pieces = pieces.len() as u32;
            m.pieces.extend_from_slice(pieces);
            m.allocs.push(a);
        }
        m
    }

    /// How many allocations it names.
    pub fn allocations(&self) -> usize {
        self.allocs.len()
    }

    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The tables a registration of `layout` sends.
    fn tables(&self, layout: &KvLayout) -> Result<RegisterTables> {
        let sizes = layout.allocations();
        if sizes.len() != self.allocs.len() {
            return Err(Error::InvalidArgument(format!(
                "the layout has {} allocations, the memory {}",
                sizes.len(),
                self.allocs.len()
            )));
        }
        if self.pieces.len() > crate::proto::kv::MAX_PIECES {
            return Err(Error::InvalidArgument(format!(
                "{} memory pieces: at most {} (describe equal VMM chunks of one allocation as one piece)",
                self.pieces.len(),
                crate::proto::kv::MAX_PIECES
            )));
        }
        Ok(self.tables_unchecked(layout))
    }

    /// The tables, with as many allocation sizes from `layout` as both have.
    pub(super) fn tables_unchecked(&self, layout: &KvLayout) -> RegisterTables {
        let sizes = layout.allocations();
        let mut t = RegisterTables {
            allocs: self.allocs.clone(),
            pieces: self.pieces.clone(),
            layers: layout.layers().to_vec(),
        };
        for (a, &bytes) in t.allocs.iter_mut().zip(sizes) {
            a.bytes = bytes;
            if self.kind == MemKind::HostFd {
                t.pieces[a.first_piece as usize].fd_bytes = bytes;
            }
        }
        t
    }
}

/// Lets the server (`server_pid`) read and write this process's memory by
/// cross-memory attach: under Yama's `ptrace_scope` 1 only a process named
/// with `PR_SET_PTRACER` may (it replaces an earlier name); scopes 2 and 3
/// forbid it, which is said here rather than as the server's `EPERM`.
fn consent_to_attach(server_pid: u32) -> Result<()> {
    // SAFETY: PR_GET_DUMPABLE takes no pointer and returns 0, 1 or 2.
    if unsafe { libc::prctl(libc::PR_GET_DUMPABLE) } == 0 {
        return Err(Error::InvalidArgument(
            "this process is not dumpable (prctl(PR_SET_DUMPABLE, 0)): no other process may access its memory".into(),
        ));
    }
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    match scope {
        0 => Ok(()),
        1 => {
            // SAFETY: PR_SET_PTRACER takes a pid by value.
            let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, server_pid as libc::c_ulong) };
            if r != 0 {
                return Err(crate::error::io("prctl(PR_SET_PTRACER)")(
                    std::io::Error::last_os_error(),
                ));
            }
            Ok(())
        }
        n => Err(Error::InvalidArgument(format!(
            "Yama ptrace_scope is {n}: no process may access another's memory, so memory in this process cannot be registered (use a memfd: HostKvCache)"
        ))),
    }
}

/// A KV cache the server has mapped, as STORE and RETRIEVE name it.
///
/// It stays usable across [`Client::reconnect`]: the client registers the
/// same memory with the new server and sends the new server's id for it.
///
/// Dropping it unregisters the cache: the request is queued with the client
/// and sent with its next synchronous request (the server unmaps the memory
/// once copies in flight have finished); if the client closes first, the
/// server unregisters it with the connection. [`Client::unregister`] does it
/// now and returns once the server has answered. Keep the cache's memory
/// alive until then, not just until the handle drops: after a drop the
/// server may copy into it until the queued request is sent (and the client
/// keeps the memory's descriptors to register it again on a reconnect). For
/// device memory, unregister explicitly before freeing it.
///
/// # Examples
///
/// ```
/// # use kvring::kv::{chunk_hashes, model_id, pattern, Dtype, KvGeometry, KvLayout, KvShape, LayoutPreset};
/// # use kvring::{Client, HostKvCache, KvSpec};
/// # use kvring_server::ServerConfig;
/// # use std::time::{Duration, Instant};
/// # let name = format!("doc-registration-{}", std::process::id());
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
/// let spec = KvSpec::new(model_id("doc-model"), 2, 0); // rank 0 of 2
/// let reg = client.register_host(&spec, &cache)?;
/// assert_eq!(reg.chunk_tokens(), 256);
/// assert_eq!(reg.blocks_per_chunk(), 16);
/// assert_eq!(client.stats()?.instances, 1);
/// client.unregister(reg)?; // or drop it: unregistered with the next request
/// assert_eq!(client.stats()?.instances, 0);
/// # client.close();
/// # server.stop();
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a Registration unregisters the KV cache"]
pub struct Registration {
    pub(super) id: u32,
    pub(super) layout: Arc<KvLayout>,
    pub(super) chunk_tokens: u32,
    /// The connection (`Link::id`) that registered it and that `id`
    /// belongs to.
    pub(super) link_id: u64,
    /// This registration, among every registration of this process.
    pub(super) key: u64,
    releases: Arc<Releases>,
    detached: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("layout", &self.layout)
            .field("chunk_tokens", &self.chunk_tokens)
            .finish()
    }
}

impl Registration {
    /// The server's id for it (of the server it was registered with).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The server's chunk size (tokens).
    pub fn chunk_tokens(&self) -> u32 {
        self.chunk_tokens
    }

    /// Blocks per chunk.
    pub fn blocks_per_chunk(&self) -> u32 {
        self.layout.blocks_per_chunk(self.chunk_tokens)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if !self.detached {
            self.releases.push(Release::Unregister(self.key));
        }
    }
}

impl Client {
    /// Registers a `HostKvCache` (with `spec.device`, the device whose copy
    /// lane serves it).
    pub fn register_host(
        &mut self,
        spec: &KvSpec,
        cache: &super::HostKvCache,
    ) -> Result<Registration> {
        self.register(spec, cache.layout(), &cache.memory(), &[cache.fd()])
    }

    /// Registers a `CudaKvCache` (its device is the cache's; `spec.device`
    /// is ignored).
    #[cfg(feature = "cuda")]
    pub fn register_cuda(
        &mut self,
        spec: &KvSpec,
        cache: &crate::client::cuda_cache::CudaKvCache,
    ) -> Result<Registration> {
        let spec = spec.on_device(cache.device_uuid());
        self.register(&spec, cache.layout(), &cache.memory(), &cache.fds())
    }

    /// Registers a KV cache of `layout` whose allocations are `memory`, with
    /// the descriptors `fds` (indexed by `memory`). Fails with a clear
    /// message when the layout does not suit the server (a block size that
    /// does not divide the chunk size, a stride that reaches past an
    /// allocation, rows that overlap, a rank out of range, ...).
    pub fn register(
        &mut self,
        spec: &KvSpec,
        layout: &KvLayout,
        memory: &Memory,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Registration> {
        let tables = memory.tables(layout)?;
        self.send_releases();
        // Kept (with duplicates of the descriptors) to register again after
        // a reconnect.
        let layout = Arc::new(layout.clone());
        let mut saved = Saved::new(spec, layout.clone(), memory.kind, tables, fds)?;
        let (id, chunk_tokens) = self.send_registration(&saved)?;
        saved.id = id;
        let reg = Registration {
            id,
            layout,
            chunk_tokens,
            link_id: self.link.id,
            key: saved.key,
            releases: self.releases.clone(),
            detached: false,
        };
        self.registrations.push(saved);
        Ok(reg)
    }

    /// Sends one registration and waits for the server's answer: the
    /// server's id for it and its chunk size.
    pub(super) fn send_registration(&mut self, saved: &Saved) -> Result<(u32, u32)> {
        let chunk_tokens = self.server_config()?.chunk_tokens;
        saved
            .layout
            .validate(chunk_tokens)
            .map_err(|e| Error::InvalidArgument(format!("KV layout refused: {e}")))?;
        self.send_unchecked(saved)
    }

    /// Sends one registration as it is (no check here: the server's are
    /// the ones that count) and waits for the answer.
    pub(super) fn send_unchecked(&mut self, saved: &Saved) -> Result<(u32, u32)> {
        if saved.mem_kind == MemKind::ProcessVm {
            // The server copies into the process that connected (its
            // credentials on the socket): after a fork that is not this one.
            if self.link.pid != std::process::id() {
                return Err(Error::InvalidArgument(format!(
                    "this connection was made by process {}, not this one ({}): memory in this process's address space needs a connection of its own",
                    self.link.pid,
                    std::process::id()
                )));
            }
            // The server as the socket names it (its pid in this process's
            // namespace), not as its segment says.
            let server = self
                .link
                .conn
                .peer_cred()
                .map_err(crate::error::io("the server's credentials"))?
                .pid;
            consent_to_attach(server)?;
        }
        let fds: Vec<BorrowedFd<'_>> = saved.fds.iter().map(|f| f.as_fd()).collect();
        let max_fds = crate::bootstrap::MAX_FDS;
        let (early, last) = fds.split_at(fds.len() - fds.len().min(max_fds));
        for batch in early.chunks(max_fds) {
            let m = crate::proto::kv::AttachFds {
                magic: BOOT_MAGIC,
                kind: BootKind::AttachFds as u32,
                count: batch.len() as u32,
            };
            self.link
                .conn
                .send(bytemuck::bytes_of(&m), batch)
                .map_err(crate::error::io("send descriptors"))?;
        }
        let spec = &saved.spec;
        let req = RegisterKv {
            magic: BOOT_MAGIC,
            kind: BootKind::Register as u32,
            mem_kind: saved.mem_kind as u32,
            model_id: spec.model_id,
            world_size: spec.world_size,
            rank: spec.rank,
            geometry: *saved.layout.geometry(),
            n_allocs: saved.tables.allocs.len() as u32,
            n_pieces: saved.tables.pieces.len() as u32,
            device_uuid: spec.device.unwrap_or_default().to_bytes(),
        };
        let msg = payload(&req, &[&saved.tables.encode()]);
        self.link
            .conn
            .send(&msg, last)
            .map_err(crate::error::io("send registration"))?;
        let r = self.boot_reply()?;
        check_boot_status(&r)?;
        Ok((r.instance, r.chunk_tokens))
    }

    /// Unregisters a KV cache now: the server unmaps its memory once copies
    /// in flight have finished.
    ///
    /// On an error the handle is dropped, which queues the unregistration
    /// again.
    pub fn unregister(&mut self, mut reg: Registration) -> Result<()> {
        let key = reg.key;
        let instance = self.server_instance(&reg)?;
        self.send_unregister(instance)?;
        reg.detached = true;
        self.registrations.retain(|s| s.key != key);
        Ok(())
    }

    /// Unregisters the registration saved under `key` (a dropped handle's).
    pub(super) fn unregister_key(&mut self, key: u64) -> Result<()> {
        let Some(s) = self.registrations.iter().find(|s| s.key == key) else {
            return Ok(());
        };
        let instance = s.id;
        self.registrations.retain(|s| s.key != key);
        self.send_unregister(instance)
    }

    pub(super) fn send_unregister(&mut self, instance: u32) -> Result<()> {
        let m = UnregisterKv {
            magic: BOOT_MAGIC,
            kind: BootKind::Unregister as u32,
            instance,
        };
        self.link
            .conn
            .send(bytemuck::bytes_of(&m), &[])
            .map_err(crate::error::io("send unregister"))?;
        let r = self.boot_reply()?;
        check_boot_status(&r)
    }

    /// The reply to the registration message just sent. Replies of earlier
    /// requests that timed out come first and are dropped; a timeout here
    /// leaves this reply owed too.
    fn boot_reply(&mut self) -> Result<RegisterReply> {
        let mut buf = [0u8; std::mem::size_of::<RegisterReply>() + 8];
        let timeout = self.opts.call_timeout;
        let deadline = std::time::Instant::now() + timeout;
        self.late_boot_replies += 1;
        let n = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let (n, _fds) = self
                .link
                .conn
                .recv(&mut buf, left)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::TimedOut => Error::Timeout(timeout),
                    _ => Error::Io {
                        context: "receive registration reply".into(),
                        source: e,
                    },
                })?;
            self.late_boot_replies -= 1;
            if self.late_boot_replies == 0 || n == 0 {
                break n;
            }
            // An earlier request's late answer: not this one's.
        };
        if n == 0 {
            return Err(Error::ServerGone);
        }
        if n != std::mem::size_of::<RegisterReply>() {
            return Err(Error::Protocol(format!("registration reply of {n} bytes")));
        }
        let r: RegisterReply = bytemuck::pod_read_unaligned(&buf[..n]);
        if r.magic != BOOT_MAGIC || r.kind != BootKind::RegisterReply as u32 {
            return Err(Error::Protocol("not a registration reply".into()));
        }
        Ok(r)
    }
}

fn check_boot_status(r: &RegisterReply) -> Result<()> {
    if r.status == 0 {
        return Ok(());
    }
    match crate::proto::Status::decode(r.status).ok() {
        Some(status) => Err(Error::Registration {
            status,
            reason: r.text(),
        }),
        None => Err(Error::UnknownStatus(r.status)),
    }
}
