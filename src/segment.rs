//! The POSIX shared-memory segment: creation by the server, attachment by
//! clients and observers, and replacement of a segment left by a dead server.
//!
//! Creation: `shm_open(O_CREAT|O_EXCL, 0600)`, take the liveness lock on the
//! new description at once, size it, write the identity fields and the region
//! table, and store `layout_version` last (Release). An attacher loads the
//! version with Acquire, so a segment whose version it accepts is complete.
//!
//! The server maps the segment through the locked description and never lets
//! that description leave the process. Clients get a second, read-only
//! description over the bootstrap socket (so their mappings can never keep
//! the server's liveness lock held after the server died, and cannot be
//! made writable: `mmap(PROT_WRITE)` and `mprotect` of it fail with
//! `EACCES`); the only memory a client writes is its own
//! ([`crate::client_memory`]).

use crate::shm_struct::Load;
use crate::error::{nix as nix_err, Error, Result};
use crate::liveness::{self, LockProbe};
use crate::client_memory::ClientMemory;
use crate::doorbell::Doorbell;
use crate::shm::{
    ClientBlock, Geometry, Offsets, OpStats, SegmentHeader, ServerClientBlock, LAYOUT_VERSION,
    MAGIC, PAGE,
};
use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

/// What a validated header says, copied out of shared memory once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub name: String,
    pub layout_version: u32,
    pub segment_bytes: u64,
    pub epoch: u64,
    pub server_pid: u32,
    pub server_uid: u32,
    pub server_start_ticks: u64,
    pub created_unix_ns: u64,
    pub geometry: Geometry,
    pub offsets: Offsets,
}

/// A mapping of a whole segment (read-write for the server, read-only for
/// everyone else) with typed accessors for its regions. The accessors hand
/// out references to atomics, so outside this crate only the server's
/// read-write mapping (`ServerSegment::mapping`) is reachable: a read-only
/// one is seen through a [`View`] of values, where a store cannot fault.
pub struct Mapping {
    map: MmapRaw,
    info: SegmentInfo,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above; every accessor hands out references to atomics only.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub fn info(&self) -> &SegmentInfo {
        &self.info
    }

    fn at<T>(&self, off: u64) -> &T {
        assert!(off as usize + std::mem::size_of::<T>() <= self.map.len());
        // SAFETY: in bounds (checked above), page- or line-aligned by the
        // layout table, and T is a repr(C) struct of atomics, for which any
        // bit pattern is valid and shared mutation is sound.
        unsafe { &*(self.map.as_ptr().add(off as usize) as *const T) }
    }

    /// Address of byte `off` as a word pointer, for ring data areas.
    pub fn words(&self, off: u64, bytes: u64) -> *const crate::sync::AtomicU64 {
        assert!(off % 8 == 0 && off + bytes <= self.map.len() as u64);
        // SAFETY: in bounds (checked above) and 8-byte aligned.
        unsafe { self.map.as_ptr().add(off as usize) as *const crate::sync::AtomicU64 }
    }

    pub fn header(&self) -> &SegmentHeader {
        self.at(0)
    }

    pub fn server_client_off(&self, slot: u32) -> u64 {
        assert!(slot < self.info.geometry.max_clients);
        self.info.offsets.server_clients_off
            + u64::from(slot) * self.info.offsets.server_client_stride
    }

    pub fn server_client(&self, slot: u32) -> &ServerClientBlock {
        self.at(self.server_client_off(slot))
    }

    /// The job table: `job_slots` slots at `jobs_off`.
    pub fn job_slots(&self) -> &[crate::jobs::JobSlot] {
        let n = self.info.geometry.job_slots as usize;
        let off = self.info.offsets.jobs_off as usize;
        assert!(off + n * std::mem::size_of::<crate::jobs::JobSlot>() <= self.map.len());
        // SAFETY: in bounds (checked above), page-aligned (the region table),
        // and JobSlot is a repr(C) struct of atomics: any bit pattern is valid
        // and shared mutation is sound.
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(off) as *const crate::jobs::JobSlot, n)
        }
    }

    /// The op stats region, at `op_stats_off`.
    pub fn op_stats(&self) -> &OpStats {
        self.at(self.info.offsets.op_stats_off)
    }

    /// The copy lanes region, at `lanes_off`.
    pub fn lanes(&self) -> &crate::shm::LaneStats {
        self.at(self.info.offsets.lanes_off)
    }

    /// The lookups-by-model region, at `models_off`.
    pub fn models(&self) -> &crate::shm::ModelStats {
        self.at(self.info.offsets.models_off)
    }

    /// A reader of this segment's job table.
    pub fn job_reader(&self) -> crate::jobs::JobReader<'_> {
        crate::jobs::JobReader::new(self.job_slots(), self.info.epoch)
    }
}

fn header_field_u32(map: &MmapRaw, off: usize) -> u32 {
    // SAFETY: callers pass offsets inside the mapped header page, 4-aligned.
    unsafe {
        (*(map.as_ptr().add(off) as *const std::sync::atomic::AtomicU32)).load(Ordering::Relaxed)
    }
}

fn header_field_u64(map: &MmapRaw, off: usize) -> u64 {
    // SAFETY: callers pass offsets inside the mapped header page, 8-aligned.
    unsafe {
        (*(map.as_ptr().add(off) as *const std::sync::atomic::AtomicU64)).load(Ordering::Relaxed)
    }
}

/// Validates a segment through `file`: owner, size, magic, version, table.
/// Reads each shared word once; returns the copy.
fn validate(name: &str, file: &File) -> Result<SegmentInfo> {
    use std::mem::offset_of as o;
    let len = crate::rundir::owned_metadata(name, file)?.len();
    if len < 16 {
        return Err(Error::NotKvring {
            name: name.into(),
            found: 0,
        });
    }
    let hdr_len = (len as usize).min(PAGE);
    let map = MmapOptions::new()
        .len(hdr_len)
        .map_raw_read_only(file)
        .map_err(crate::error::io(format!("mmap {name}")))?;
    let magic = header_field_u64(&map, o!(SegmentHeader, magic));
    if magic != MAGIC {
        return Err(Error::NotKvring {
            name: name.into(),
            found: magic,
        });
    }
    if hdr_len < PAGE {
        return Err(Error::Truncated {
            name: name.into(),
            len,
            expected: PAGE as u64,
        });
    }
    // SAFETY: offset 8 is inside the header page and 4-aligned.
    let version = unsafe {
        &*(map.as_ptr().add(o!(SegmentHeader, layout_version))
            as *const std::sync::atomic::AtomicU32)
    }
    // Acquire pairs with the server's Release store in `ServerSegment::create`:
    // every identity field below was written before it.
    .load(Ordering::Acquire);
    if version == 0 {
        return Err(Error::NotReady { name: name.into() });
    }
    if version != LAYOUT_VERSION {
        return Err(Error::LayoutVersion {
            name: name.into(),
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let geometry = Geometry {
        max_clients: header_field_u32(&map, o!(SegmentHeader, max_clients)),
        req_ring_bytes: header_field_u32(&map, o!(SegmentHeader, req_ring_bytes)),
        cq_ring_bytes: header_field_u32(&map, o!(SegmentHeader, cq_ring_bytes)),
        max_frame_bytes: header_field_u32(&map, o!(SegmentHeader, max_frame_bytes)),
        job_slots: header_field_u32(&map, o!(SegmentHeader, job_slots)),
    };
    let bad = |reason: String| Error::BadTable {
        name: name.into(),
        reason,
    };
    geometry.validate().map_err(|e| bad(e.to_string()))?;
    let expected = geometry.offsets();
    let found = Offsets {
        server_clients_off: header_field_u64(&map, o!(SegmentHeader, server_clients_off)),
        server_client_stride: header_field_u64(&map, o!(SegmentHeader, server_client_stride)),
        client_memory_bytes: header_field_u64(&map, o!(SegmentHeader, client_memory_bytes)),
        // Not in the header: follows from the geometry.
        job_words_off: expected.job_words_off,
        jobs_off: header_field_u64(&map, o!(SegmentHeader, jobs_off)),
        job_stride: header_field_u64(&map, o!(SegmentHeader, job_stride)),
        op_stats_off: header_field_u64(&map, o!(SegmentHeader, op_stats_off)),
        lanes_off: header_field_u64(&map, o!(SegmentHeader, lanes_off)),
        models_off: header_field_u64(&map, o!(SegmentHeader, models_off)),
        segment_bytes: header_field_u64(&map, o!(SegmentHeader, segment_bytes)),
    };
    if found != expected {
        return Err(bad(format!(
            "table {found:?} does not match geometry {geometry:?}"
        )));
    }
    if header_field_u32(&map, o!(SegmentHeader, header_bytes)) as usize != PAGE {
        return Err(bad("header size is not one page".into()));
    }
    if len < expected.segment_bytes {
        return Err(Error::Truncated {
            name: name.into(),
            len,
            expected: expected.segment_bytes,
        });
    }
    Ok(SegmentInfo {
        name: name.into(),
        layout_version: version,
        segment_bytes: expected.segment_bytes,
        epoch: header_field_u64(&map, o!(SegmentHeader, epoch)),
        server_pid: header_field_u32(&map, o!(SegmentHeader, server_pid)),
        server_uid: header_field_u32(&map, o!(SegmentHeader, server_uid)),
        server_start_ticks: header_field_u64(&map, o!(SegmentHeader, server_start_ticks)),
        created_unix_ns: header_field_u64(&map, o!(SegmentHeader, created_unix_ns)),
        geometry,
        offsets: expected,
    })
}

/// A read-only mapping of a segment, as its words' values: each struct is
/// loaded word by word (Acquire) into its plain `…Values` twin, so no
/// reference to memory mapped `PROT_READ` reaches safe code, and nothing
/// can store to it (a store there would fault).
///
/// ```compile_fail
/// # fn main() -> kvring::Result<()> {
/// let seg = kvring::segment::ReadOnlySegment::open("default")?;
/// let h: &kvring::shm::SegmentHeader = seg.mapping.header(); // private
/// # Ok(())
/// # }
/// ```
///
/// Every word is loaded Acquire: it pairs with the server's Release store
/// of the words a protocol publishes (`layout_version`, a job slot's `seq`,
/// ring indices), and costs nothing more than Relaxed on x86-64 for the
/// counters that have no pairing store.
#[derive(Clone, Copy)]
pub struct View<'a>(&'a Mapping);

impl<'a> View<'a> {
    pub fn info(&self) -> &'a SegmentInfo {
        self.0.info()
    }

    pub fn header(&self) -> crate::shm::SegmentHeaderValues {
        self.0.header().load_value(Ordering::Acquire)
    }

    /// Client slot `slot`'s server-written block.
    pub fn server_client(&self, slot: u32) -> crate::shm::ServerClientBlockValues {
        self.0.server_client(slot).load_value(Ordering::Acquire)
    }

    /// The client-written block of the session in slot `slot` now, read
    /// from that client's own memory (the server's descriptor of it, opened
    /// read-only through `/proc`); an error once the session ended or the
    /// server died.
    pub fn client_block(&self, slot: u32) -> Result<crate::shm::ClientBlockValues> {
        let sb = self.server_client(slot);
        let info = self.info();
        let mem = ClientMemory::open_read_only(
            info.server_pid,
            sb.memory_fd,
            &crate::client_memory::name(&info.name, slot, sb.session),
            info.offsets.client_memory_bytes,
        )?;
        let values = mem.values();
        // Still that session (its memory could have been closed and the
        // descriptor number reused meanwhile, by the same name only if the
        // session were the same).
        let now = self.server_client(slot);
        if now.session != sb.session || now.state != crate::shm::SlotState::Active as u32 {
            return Err(Error::Protocol(format!("slot {slot}'s session ended")));
        }
        Ok(values)
    }

    /// Job slot `index`'s words, each on its own (a consistent read of a job
    /// is [`View::job_reader`]'s).
    pub fn job_slot(&self, index: u32) -> crate::jobs::JobSlotValues {
        self.0.job_slots()[index as usize].load_value(Ordering::Acquire)
    }

    pub fn op_stats(&self) -> crate::shm::OpStatsValues {
        self.0.op_stats().load_value(Ordering::Acquire)
    }

    /// Copy lane `lane`'s words (`lane < MAX_LANES`).
    pub fn lane(&self, lane: usize) -> crate::shm::LaneStatValues {
        self.0.lanes().lanes[lane].load_value(Ordering::Acquire)
    }

    /// Row `row` of the lookups-by-model region (`row < MODEL_ROWS`).
    pub fn model_row(&self, row: usize) -> crate::shm::ModelStatValues {
        self.0.models().rows[row].load_value(Ordering::Acquire)
    }

    /// A reader of the job table (seqlock reads; loads only).
    pub fn job_reader(&self) -> crate::jobs::JobReader<'a> {
        self.0.job_reader()
    }
}

/// A read-only attachment (observers, tests, the inspector): maps the whole
/// segment PROT_READ through its own read-only description.
pub struct ReadOnlySegment {
    pub(crate) mapping: Mapping,
    file: File,
}

impl ReadOnlySegment {
    /// Opens and validates the segment of server `name` read-only.
    pub fn open(name: &str) -> Result<ReadOnlySegment> {
        crate::rundir::check_name(name)?;
        Self::open_shm(&crate::rundir::shm_name(name))
    }

    /// Opens and validates the shm object `shm_name` (with leading '/').
    pub fn open_shm(shm_name: &str) -> Result<ReadOnlySegment> {
        let fd =
            nix::sys::mman::shm_open(shm_name, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(nix_err(format!("shm_open {shm_name}")))?;
        let file = File::from(fd);
        let info = validate(shm_name, &file)?;
        let map = MmapOptions::new()
            .len(info.segment_bytes as usize)
            .map_raw_read_only(&file)
            .map_err(crate::error::io(format!("mmap {shm_name}")))?;
        Ok(ReadOnlySegment {
            mapping: Mapping { map, info },
            file,
        })
    }

    /// The segment's words as values (the mapping is read-only).
    pub fn view(&self) -> View<'_> {
        View(&self.mapping)
    }

    /// Whether the server that owns this segment is alive (its liveness lock
    /// is held). Proof, not a pid guess: the kernel drops the lock at exit.
    pub fn server_alive(&self) -> Result<bool> {
        Ok(liveness::probe_lock(self.file.as_fd())
            .map_err(crate::error::io("probing the server lock"))?
            == LockProbe::Held)
    }
}

/// The client's view: the whole segment read-only (through a read-only
/// descriptor: it cannot be remapped writable), its own memory read-write,
/// and its doorbell.
pub struct ClientSegment {
    pub(crate) mapping: Mapping,
    memory: ClientMemory,
    doorbell: Doorbell,
    file: File,
}

impl ClientSegment {
    /// Attaches through the descriptors received from the server: the
    /// segment (read-only), this session's memory and its doorbell.
    pub(crate) fn attach(
        name: &str,
        segment: OwnedFd,
        memory: OwnedFd,
        doorbell: OwnedFd,
        slot: u32,
    ) -> Result<ClientSegment> {
        let file = File::from(segment);
        let info = validate(name, &file)?;
        if slot >= info.geometry.max_clients {
            return Err(Error::Protocol(format!("slot {slot} out of range")));
        }
        let ro = MmapOptions::new()
            .len(info.segment_bytes as usize)
            .map_raw_read_only(&file)
            .map_err(crate::error::io(format!("mmap {name}")))?;
        let memory = ClientMemory::attach(
            memory,
            info.offsets.client_memory_bytes,
            info.offsets.job_words_off,
        )?;
        Ok(ClientSegment {
            mapping: Mapping { map: ro, info },
            memory,
            doorbell: Doorbell::from_fd(doorbell),
            file,
        })
    }

    /// The segment's words as values (this client's writable memory is
    /// [`ClientSegment::block_rw`]).
    pub fn view(&self) -> View<'_> {
        View(&self.mapping)
    }

    /// This client's block, writable (in its own memory object).
    pub fn block_rw(&self) -> &ClientBlock {
        self.memory.block()
    }

    /// This client's request ring data, writable.
    pub(crate) fn req_data_rw(&self) -> *const crate::sync::AtomicU64 {
        self.memory.req_data()
    }

    /// This session's job words (in its own memory).
    pub(crate) fn memory(&self) -> &ClientMemory {
        &self.memory
    }

    /// The doorbell that wakes the server's ring loop for this client.
    pub fn doorbell(&self) -> &Doorbell {
        &self.doorbell
    }

    /// Stores `word` at word `index` (modulo the ring) of this client's
    /// request ring data, bypassing the ring protocol: for fault tests that
    /// play a hostile or broken client. The server must survive anything
    /// written here.
    #[doc(hidden)]
    pub fn scribble_request_ring(&self, index: usize, word: u64) {
        let words = self.mapping.info().geometry.req_ring_bytes as usize / 8;
        // SAFETY: the index is reduced into the ring's `words` words, all
        // inside this client's writable memory mapping.
        unsafe {
            (*self.req_data_rw().add(index % words))
                .store(word, std::sync::atomic::Ordering::Relaxed)
        };
    }

    /// Whether the server's liveness lock is held (it is alive).
    pub fn server_alive(&self) -> bool {
        liveness::probe_lock(self.file.as_fd())
            .map(|p| p == LockProbe::Held)
            .unwrap_or(false)
    }
}

/// The server's segment: the read-write mapping, the locked description, and
/// the description handed to clients.
pub struct ServerSegment {
    /// Shared with the board the cache service publishes its counters on,
    /// which writes them for as long as it lives.
    pub mapping: std::sync::Arc<Mapping>,
    /// Holds the liveness lock; never shared, never duplicated.
    _lock_fd: OwnedFd,
    /// A second description of the same object, sent to clients.
    share_fd: OwnedFd,
    shm_name: String,
}

impl ServerSegment {
    /// Creates the segment `shm_name`, replacing one whose server is proven
    /// dead. The caller holds the start-up lock of this name, so no other
    /// server of this runtime directory races with us here.
    pub fn create(shm_name: &str, geometry: Geometry) -> Result<ServerSegment> {
        geometry
            .validate()
            .map_err(|e| Error::Config(e.to_string()))?;
        let mut epoch_floor = 0;
        // A segment of this name already exists: replace it only if it is a
        // kvring segment (or an empty one) whose server is dead.
        match nix::sys::mman::shm_open(shm_name, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty()) {
            Ok(fd) => {
                let file = File::from(fd);
                if liveness::probe_lock(file.as_fd()).map_err(crate::error::io("probe lock"))?
                    == LockProbe::Held
                {
                    let pid = ReadOnlySegment::open_shm(shm_name)
                        .map(|s| s.mapping.info.server_pid)
                        .unwrap_or(0);
                    return Err(Error::AlreadyRunning {
                        name: shm_name.into(),
                        pid,
                    });
                }
                match validate(shm_name, &file) {
                    Ok(info) => epoch_floor = info.epoch,
                    Err(Error::NotKvring { found: 0, .. }) if file_len(&file) == 0 => {}
                    Err(e @ (Error::WrongOwner { .. } | Error::NotKvring { .. })) => {
                        return Err(match e {
                            Error::NotKvring { .. } => Error::NotOurs {
                                name: shm_name.into(),
                            },
                            e => e,
                        })
                    }
                    // A kvring segment of another version, truncated or
                    // half-initialised, whose server is dead: stale.
                    Err(_) => {}
                }
                nix::sys::mman::shm_unlink(shm_name)
                    .map_err(nix_err(format!("shm_unlink {shm_name}")))?;
            }
            Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(nix_err(format!("shm_open {shm_name}"))(e)),
        }

        let fd = nix::sys::mman::shm_open(
            shm_name,
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(nix_err(format!("shm_open(O_EXCL) {shm_name}")))?;
        if !liveness::try_lock(fd.as_fd()).map_err(crate::error::io("lock segment"))? {
            return Err(Error::AlreadyRunning {
                name: shm_name.into(),
                pid: 0,
            });
        }
        let off = geometry.offsets();
        nix::unistd::ftruncate(&fd, off.segment_bytes as i64)
            .map_err(nix_err("ftruncate segment"))?;
        let file = File::from(fd);
        let map = MmapOptions::new()
            .len(off.segment_bytes as usize)
            .map_raw(&file)
            .map_err(crate::error::io("mmap segment"))?;
        let epoch = liveness::unix_ns().max(epoch_floor + 1);
        let info = SegmentInfo {
            name: shm_name.into(),
            layout_version: LAYOUT_VERSION,
            segment_bytes: off.segment_bytes,
            epoch,
            server_pid: std::process::id(),
            server_uid: crate::rundir::euid(),
            server_start_ticks: liveness::process_start_ticks(std::process::id()).unwrap_or(0),
            created_unix_ns: liveness::unix_ns(),
            geometry,
            offsets: off,
        };
        let mapping = Mapping { map, info };
        let h = mapping.header();
        let r = Ordering::Relaxed;
        h.magic.store(MAGIC, r);
        h.header_bytes.store(PAGE as u32, r);
        h.segment_bytes.store(off.segment_bytes, r);
        h.epoch.store(epoch, r);
        h.server_pid.store(mapping.info.server_pid, r);
        h.server_uid.store(mapping.info.server_uid, r);
        h.server_start_ticks
            .store(mapping.info.server_start_ticks, r);
        h.created_unix_ns.store(mapping.info.created_unix_ns, r);
        h.max_clients.store(geometry.max_clients, r);
        h.job_slots.store(geometry.job_slots, r);
        h.req_ring_bytes.store(geometry.req_ring_bytes, r);
        h.cq_ring_bytes.store(geometry.cq_ring_bytes, r);
        h.max_frame_bytes.store(geometry.max_frame_bytes, r);
        h.server_clients_off.store(off.server_clients_off, r);
        h.server_client_stride.store(off.server_client_stride, r);
        h.client_memory_bytes.store(off.client_memory_bytes, r);
        h.jobs_off.store(off.jobs_off, r);
        h.job_stride.store(off.job_stride, r);
        h.op_stats_off.store(off.op_stats_off, r);
        h.lanes_off.store(off.lanes_off, r);
        h.models_off.store(off.models_off, r);
        h.heartbeat_ns.store(liveness::monotonic_ns(), r);
        // Published last. Release pairs with the Acquire load in `validate`.
        h.layout_version.store(LAYOUT_VERSION, Ordering::Release);

        // Read-only: a client can map it, never remap it writable.
        let share_fd =
            nix::sys::mman::shm_open(shm_name, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(nix_err("reopen segment for clients"))?;
        Ok(ServerSegment {
            mapping: std::sync::Arc::new(mapping),
            _lock_fd: OwnedFd::from(file),
            share_fd,
            shm_name: shm_name.into(),
        })
    }

    /// The description to hand to clients (read-only).
    pub fn share_fd(&self) -> &OwnedFd {
        &self.share_fd
    }

    /// Removes the segment's name (the server does this at clean shutdown).
    pub fn unlink(&self) {
        let _ = nix::sys::mman::shm_unlink(self.shm_name.as_str());
    }
}

fn file_len(f: &File) -> u64 {
    f.metadata().map(|m| m.len()).unwrap_or(0)
}
