//! One client's own memory: the only memory a client can write.
//!
//! A memfd per client session, created by the server at the hello and
//! sealed against resizing (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`)
//! before the client sees it, so no client can truncate it under the
//! server's mapping (a load from a truncated shared mapping is a SIGBUS).
//! It holds the session's [`ClientBlock`] (one page), its request ring's
//! data and its [`crate::job_words`]. The client maps it writable through
//! the descriptor it receives; the server maps it read-only and treats every
//! word in it as untrusted; it maps the job words writable too (its copies
//! report there what they did; `cancel`, the one word it reads there, is as
//! untrusted as the rest);
//! an observer opens the server's descriptor of it read-only through
//! `/proc/SERVER_PID/fd/N` (`ServerClientBlock::memory_fd`), while the
//! server lives. The segment itself reaches a client only as a read-only
//! descriptor.
//!
//! A new session gets a new memfd, so whatever the previous occupant of a
//! slot still writes to its own (after a goodbye, or while its process
//! lingers) reaches memory nobody reads. The server closes its descriptor
//! when the session's slot is reclaimed; nothing is left in the file system
//! when a server dies.

use crate::error::{nix as nix_err, Error, Result};
use crate::shm::{ClientBlock, ClientBlockValues, PAGE};
use crate::shm_struct::Load;
use memmap2::{MmapOptions, MmapRaw};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

/// Name of the memory of session `session` in slot `slot` of the server
/// whose segment is `segment` (with its leading '/'): `kvring-UID-NAME.SLOT.SESSION`.
pub fn name(segment: &str, slot: u32, session: u32) -> String {
    format!("{}.{slot}.{session}", segment.trim_start_matches('/'))
}

/// A mapping of one client's memory: writable in its client, read-only in
/// the server and observers.
pub struct ClientMemory {
    map: MmapRaw,
    /// Offset of the job words (writable mappings only).
    words_off: Option<usize>,
}

// SAFETY: shared memory accessed through atomics only.
unsafe impl Send for ClientMemory {}
// SAFETY: as above.
unsafe impl Sync for ClientMemory {}

/// Seals a session's memory carries: it can never be resized, nor the seals
/// removed.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

impl ClientMemory {
    /// Maps `file` (of `bytes` bytes, owned by this user) read-only or
    /// read-write.
    fn map(what: &str, file: &File, bytes: u64, writable: bool) -> Result<ClientMemory> {
        let md = crate::rundir::owned_metadata(what, file)?;
        if md.len() != bytes {
            return Err(Error::Truncated {
                name: what.into(),
                len: md.len(),
                expected: bytes,
            });
        }
        let opts = {
            let mut o = MmapOptions::new();
            o.len(bytes as usize);
            o
        };
        let map = if writable {
            opts.map_raw(file)
        } else {
            opts.map_raw_read_only(file)
        }
        .map_err(crate::error::io(format!("mmap {what}")))?;
        Ok(ClientMemory {
            map,
            words_off: None,
        })
    }

    /// The client's side: maps the descriptor it received, writable; its
    /// job words are at `words_off`.
    pub(crate) fn attach(fd: OwnedFd, bytes: u64, words_off: u64) -> Result<ClientMemory> {
        if words_off + crate::job_words::REGION_BYTES as u64 > bytes {
            return Err(Error::Protocol(format!(
                "job words at {words_off} do not fit in {bytes} bytes of client memory"
            )));
        }
        let mut m = Self::map("client memory", &File::from(fd), bytes, true)?;
        m.words_off = Some(words_off as usize);
        Ok(m)
    }

    /// The job words, in a writable mapping (the client's).
    pub fn words(&self) -> Option<crate::job_words::Words<'_>> {
        let off = self.words_off?;
        // SAFETY: `attach` checked that the region lies inside the mapping,
        // which is writable and lives as long as `self`.
        Some(unsafe { crate::job_words::Words::new(self.map.as_mut_ptr().add(off)) })
    }

    /// Where the job words are in this process.
    #[cfg(feature = "cuda")]
    pub(crate) fn words_range(&self) -> Option<(*mut u8, usize)> {
        let off = self.words_off?;
        // SAFETY: inside the mapping (checked in `attach`).
        Some((unsafe { self.map.as_mut_ptr().add(off) }, crate::job_words::REGION_BYTES))
    }

    /// An observer's side: opens descriptor `fd` of the live server `pid`
    /// (its `ServerClientBlock::memory_fd` of a slot) read-only, if it is the
    /// memfd named `name` (see [`name`]): the descriptor number may have been
    /// reused since the observer read it. It is first opened as a path only
    /// (opening a FIFO or a device through `/proc` would block or run its
    /// driver), its name checked, then reopened read-only; only a sealed
    /// memfd of exactly `bytes` bytes is mapped, so nobody can truncate it
    /// under the observer.
    pub fn open_read_only(pid: u32, fd: u32, name: &str, bytes: u64) -> Result<ClientMemory> {
        use nix::fcntl::{open, readlink, OFlag};
        use nix::sys::stat::Mode;
        let path = format!("/proc/{pid}/fd/{fd}");
        let handle = open(path.as_str(), OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(nix_err(format!("open {path}")))?;
        let own = format!("/proc/self/fd/{}", handle.as_raw_fd());
        let target = readlink(own.as_str()).map_err(nix_err(format!("readlink {path}")))?;
        let want = format!("/memfd:{name}");
        let target = target.to_string_lossy();
        if target != want && target != format!("{want} (deleted)") {
            return Err(Error::Protocol(format!(
                "{path} is {target}, not the client memory {want}"
            )));
        }
        let fd = open(
            own.as_str(),
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(nix_err(format!("reopen {path}")))?;
        let file = File::from(fd);
        // SAFETY: F_GET_SEALS on a descriptor this function owns.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(Error::Protocol(format!(
                "{path} is not a sealed client memory object"
            )));
        }
        Self::map(&path, &file, bytes, false)
    }

    /// The client block. Internal: over a read-only mapping it may only be
    /// loaded from.
    pub fn block(&self) -> &ClientBlock {
        // SAFETY: the mapping is at least a page long (its size was checked
        // against `PAGE + req_ring_bytes`, and the object cannot be resized)
        // and page-aligned; `ClientBlock` is a repr(C) struct of atomics,
        // valid for any bits and sound to share.
        unsafe { &*(self.map.as_ptr() as *const ClientBlock) }
    }

    /// The request ring's data, at +[`PAGE`].
    pub fn req_data(&self) -> *const crate::sync::AtomicU64 {
        // SAFETY: the mapping is `PAGE + req_ring_bytes` long, so PAGE is in
        // bounds (the ring's words follow); page-aligned, so 8-aligned.
        unsafe { self.map.as_ptr().add(PAGE) as *const crate::sync::AtomicU64 }
    }

    /// The client block's words as values.
    pub fn values(&self) -> ClientBlockValues {
        // Acquire: pairs with the client's Release stores of its ring
        // indices; the rest are counters for observers.
        self.block().load_value(Ordering::Acquire)
    }
}

/// The server's record of one client's memory: its read-only mapping, a
/// writable mapping of its job words and its descriptor (kept open for
/// observers), closed when the record is dropped (the session ended, and
/// no copy of its jobs is left: each job holds the record).
pub struct OwnedClientMemory {
    /// The job words registered with the CUDA driver (for the copies'
    /// device-side reads and writes), at first use; dropped (unregistered)
    /// before the mapping goes.
    #[cfg(feature = "cuda")]
    registered: std::sync::Mutex<Option<(crate::gpu::HostRegistration, u64)>>,
    words: MmapRaw,
    mem: ClientMemory,
    fd: OwnedFd,
}

impl OwnedClientMemory {
    /// Creates the memory of a new session, zero-filled and sealed, and
    /// returns the server's record of it and the read-write descriptor for
    /// the client.
    pub fn create(
        name: &str,
        bytes: u64,
        words_off: u64,
    ) -> Result<(OwnedClientMemory, OwnedFd)> {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("memfd name {name:?}")))?;
        let fd = memfd_create(
            cname.as_c_str(),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(nix_err("memfd_create"))?;
        nix::unistd::ftruncate(&fd, bytes as i64).map_err(nix_err("ftruncate client memory"))?;
        // SAFETY: F_ADD_SEALS on a descriptor this function owns; it only
        // adds seals.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(Error::Io {
                context: "seal client memory".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        let client = fd.try_clone().map_err(crate::error::io("dup client memory"))?;
        let file = File::from(fd);
        let mem = ClientMemory::map(name, &file, bytes, false)?;
        if words_off + crate::job_words::REGION_BYTES as u64 > bytes {
            return Err(Error::InvalidArgument(format!(
                "job words at {words_off} do not fit in {bytes} bytes"
            )));
        }
        let words = MmapOptions::new()
            .offset(words_off)
            .len(crate::job_words::REGION_BYTES)
            .map_raw(&file)
            .map_err(crate::error::io(format!("mmap the job words of {name}")))?;
        Ok((
            OwnedClientMemory {
                #[cfg(feature = "cuda")]
                registered: std::sync::Mutex::new(None),
                words,
                mem,
                fd: OwnedFd::from(file),
            },
            client,
        ))
    }

    /// The session's job words (written by the client too: untrusted).
    pub fn words(&self) -> crate::job_words::Words<'_> {
        // SAFETY: a writable mapping of exactly the region, living as long
        // as `self`; the object cannot shrink (sealed).
        unsafe { crate::job_words::Words::new(self.words.as_mut_ptr()) }
    }

    /// The device address of the job words, registering them with the
    /// driver (portable: every context) at the first call, in `ctx`.
    #[cfg(feature = "cuda")]
    pub fn words_device_ptr(
        &self,
        ctx: &std::sync::Arc<crate::gpu::Context>,
    ) -> std::result::Result<u64, crate::gpu::CudaError> {
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, dev)) = r.as_ref() {
            return Ok(*dev);
        }
        // SAFETY: the mapping is readable and writable and outlives the
        // registration (declared first, so dropped first).
        let reg = unsafe {
            crate::gpu::HostRegistration::new(
                ctx,
                self.words.as_mut_ptr(),
                crate::job_words::REGION_BYTES,
            )
        }?;
        let dev = reg.device_ptr()?;
        *r = Some((reg, dev));
        Ok(dev)
    }

    pub fn memory(&self) -> &ClientMemory {
        &self.mem
    }

    /// The server's descriptor number (observers open it through `/proc`).
    pub fn raw_fd(&self) -> u32 {
        self.fd.as_raw_fd() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_maps_it_read_only_and_nobody_can_resize_it() {
        let bytes = (2 * PAGE + crate::job_words::REGION_BYTES) as u64;
        let words_off = 2 * PAGE as u64;
        let (own, fd) = OwnedClientMemory::create("kvring-test-memory", bytes, words_off).unwrap();
        let probe = fd.try_clone().unwrap();
        let client = ClientMemory::attach(fd, bytes, words_off).unwrap();
        client.block().req_tail.store(88, Ordering::Release);
        assert_eq!(own.memory().values().req_tail, 88);
        // Both ends see each other's job words.
        client.words().unwrap().give_up(3, 9);
        assert!(own.words().cancelled(3, 9));
        own.words().release(3, 9);
        assert!(client.words().unwrap().released(3, 9));
        let observer = ClientMemory::open_read_only(
            std::process::id(),
            own.raw_fd(),
            "kvring-test-memory",
            bytes,
        )
        .unwrap();
        // Another name at that descriptor is refused.
        assert!(ClientMemory::open_read_only(
            std::process::id(),
            own.raw_fd(),
            "kvring-test-other",
            bytes
        )
        .is_err());
        assert_eq!(observer.values().req_tail, 88);
        // The client's descriptor can write the words but never resize.
        assert_eq!(
            nix::unistd::ftruncate(&probe, 0),
            Err(nix::errno::Errno::EPERM)
        );
        assert_eq!(
            nix::unistd::ftruncate(&probe, 2 * bytes as i64),
            Err(nix::errno::Errno::EPERM)
        );
        // SAFETY: F_ADD_SEALS on a descriptor this test owns.
        let r = unsafe { libc::fcntl(probe.as_raw_fd(), libc::F_ADD_SEALS, 0) };
        assert_eq!(r, -1, "the seals can be changed");
        drop(own);
        client.block().req_tail.store(96, Ordering::Release);
        assert_eq!(observer.values().req_tail, 96);
    }

    #[test]
    fn a_descriptor_of_the_wrong_size_is_refused() {
        let bytes = (PAGE + crate::job_words::REGION_BYTES) as u64;
        let (_own, fd) = OwnedClientMemory::create("kvring-test-size", bytes, PAGE as u64).unwrap();
        assert!(matches!(
            ClientMemory::attach(fd, bytes + 4096, PAGE as u64),
            Err(Error::Truncated { .. })
        ));
    }

    #[test]
    fn an_observer_maps_only_sealed_memory() {
        let plain = nix::sys::memfd::memfd_create(
            c"kvring-test-plain",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .unwrap();
        nix::unistd::ftruncate(&plain, 8192).unwrap();
        assert!(ClientMemory::open_read_only(
            std::process::id(),
            plain.as_raw_fd() as u32,
            "kvring-test-plain",
            8192
        )
        .is_err());
        // A pipe's reading end with no writer: refused by name, and never
        // opened for reading (that would block).
        let (rx, tx) = nix::unistd::pipe().unwrap();
        drop(tx);
        assert!(ClientMemory::open_read_only(
            std::process::id(),
            rx.as_raw_fd() as u32,
            "kvring-test-plain",
            8192
        )
        .is_err());
    }
}
