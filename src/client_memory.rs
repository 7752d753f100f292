//! One client's own memory: the only memory a client can write.
//!
//! A POSIX shm object per client session, `/kvring-UID-NAME@EPOCH.SLOT.SESSION`
//! (`@` never occurs in a server name, so a server's objects share a
//! prefix no other server's name has), mode 0600, created by the server at
//! the hello and holding the session's [`ClientBlock`] (one page) and its
//! request ring's data. The client maps it writable through the descriptor
//! it receives; the server maps it read-only and treats every word in it as
//! untrusted; the inspector opens it read-only by name. The segment itself
//! reaches a client only as a read-only descriptor.
//!
//! A new session gets a new object, so whatever the previous occupant of a
//! slot still writes to its own (after a goodbye, or while its process
//! lingers) reaches memory nobody reads. The server removes the name when
//! the session's slot is reclaimed (and, at start, every name a dead server
//! of the same name left).

use crate::error::{nix as nix_err, Error, Result};
use crate::shm::{ClientBlock, ClientBlockValues, PAGE};
use crate::shm_struct::Load;
use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

/// Name of the memory object of session `session` in slot `slot` of the
/// server whose segment is `segment` (with its leading '/') and epoch `epoch`.
pub fn name(segment: &str, epoch: u64, slot: u32, session: u32) -> String {
    format!("{segment}@{epoch}.{slot}.{session}")
}

/// A mapping of one client's memory: writable in its client, read-only in
/// the server and observers.
pub struct ClientMemory {
    map: MmapRaw,
}

// SAFETY: shared memory accessed through atomics only.
unsafe impl Send for ClientMemory {}
// SAFETY: as above.
unsafe impl Sync for ClientMemory {}

impl ClientMemory {
    /// Maps `file` (of `bytes` bytes, owned by this user) read-only or
    /// read-write.
    fn map(what: &str, file: &File, bytes: u64, writable: bool) -> Result<ClientMemory> {
        use std::os::unix::fs::MetadataExt;
        let md = file
            .metadata()
            .map_err(crate::error::io(format!("fstat {what}")))?;
        let me = crate::rundir::euid();
        if md.uid() != me {
            return Err(Error::WrongOwner {
                name: what.into(),
                owner: md.uid(),
                me,
            });
        }
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
        Ok(ClientMemory { map })
    }

    /// The client's side: maps the descriptor it received, writable.
    pub(crate) fn attach(fd: OwnedFd, bytes: u64) -> Result<ClientMemory> {
        Self::map("client memory", &File::from(fd), bytes, true)
    }

    /// An observer's side: opens session `session` of slot `slot` by name,
    /// read-only.
    pub fn open_read_only(
        segment: &str,
        epoch: u64,
        slot: u32,
        session: u32,
        bytes: u64,
    ) -> Result<ClientMemory> {
        let name = name(segment, epoch, slot, session);
        let fd =
            nix::sys::mman::shm_open(name.as_str(), OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(nix_err(format!("shm_open {name}")))?;
        Self::map(&name, &File::from(fd), bytes, false)
    }

    /// The client block. Internal: over a read-only mapping it may only be
    /// loaded from.
    pub(crate) fn block(&self) -> &ClientBlock {
        // SAFETY: the mapping is at least a page long (its size was checked
        // against `PAGE + req_ring_bytes`) and page-aligned; `ClientBlock` is
        // a repr(C) struct of atomics, valid for any bits and sound to
        // share.
        unsafe { &*(self.map.as_ptr() as *const ClientBlock) }
    }

    /// The request ring's data, at +[`PAGE`].
    pub(crate) fn req_data(&self) -> *const crate::sync::AtomicU64 {
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

/// The server's record of one client's memory: its read-only mapping and the
/// object's name, removed when the record is dropped (the session ended).
pub(crate) struct OwnedClientMemory {
    mem: ClientMemory,
    name: String,
}

impl OwnedClientMemory {
    /// Creates the object of a new session, zero-filled, and returns the
    /// server's record of it and the read-write descriptor for the client.
    pub fn create(
        segment: &str,
        epoch: u64,
        slot: u32,
        session: u32,
        bytes: u64,
    ) -> Result<(OwnedClientMemory, OwnedFd)> {
        let name = name(segment, epoch, slot, session);
        // A leftover of the same name can only be a dead process's: this
        // server's names are unique (epoch, slot, session), and it removes
        // each before it could come again.
        let _ = nix::sys::mman::shm_unlink(name.as_str());
        let fd = nix::sys::mman::shm_open(
            name.as_str(),
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(nix_err(format!("shm_open(O_EXCL) {name}")))?;
        let made = (|| {
            nix::unistd::ftruncate(&fd, bytes as i64).map_err(nix_err("ftruncate client memory"))?;
            let file = File::from(fd.try_clone().map_err(crate::error::io("dup client memory"))?);
            ClientMemory::map(&name, &file, bytes, false)
        })();
        match made {
            Ok(mem) => Ok((OwnedClientMemory { mem, name }, fd)),
            Err(e) => {
                let _ = nix::sys::mman::shm_unlink(name.as_str());
                Err(e)
            }
        }
    }

    pub fn memory(&self) -> &ClientMemory {
        &self.mem
    }
}

impl Drop for OwnedClientMemory {
    fn drop(&mut self) {
        let _ = nix::sys::mman::shm_unlink(self.name.as_str());
    }
}

/// Removes every client memory object of server segment `segment` (any
/// epoch): what a server of this name left when it died. Servers do it at
/// start (holding the name's start-up lock, so no live server owns any of
/// them) and at clean shutdown; so can whoever removes a dead server's
/// segment by hand.
pub fn sweep(segment: &str) {
    let prefix = format!("{}@", segment.trim_start_matches('/'));
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        let Ok(file) = e.file_name().into_string() else {
            continue;
        };
        if file.starts_with(&prefix) {
            let _ = nix::sys::mman::shm_unlink(format!("/{file}").as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment_name(tag: &str) -> String {
        format!("/kvring-{}-cm-{tag}-{}", crate::rundir::euid(), std::process::id())
    }

    #[test]
    fn the_server_maps_it_read_only_and_removes_its_name() {
        let seg = segment_name("own");
        let bytes = (PAGE + 4096) as u64;
        let (own, fd) = OwnedClientMemory::create(&seg, 7, 3, 1, bytes).unwrap();
        let client = ClientMemory::attach(fd, bytes).unwrap();
        client.block().req_tail.store(88, Ordering::Release);
        assert_eq!(own.memory().values().req_tail, 88);
        let observer = ClientMemory::open_read_only(&seg, 7, 3, 1, bytes).unwrap();
        assert_eq!(observer.values().req_tail, 88);
        drop(own);
        assert!(ClientMemory::open_read_only(&seg, 7, 3, 1, bytes).is_err());
        // The client's mapping outlives the name.
        client.block().req_tail.store(96, Ordering::Release);
        assert_eq!(observer.values().req_tail, 96);
    }

    #[test]
    fn a_sweep_removes_one_servers_objects_and_no_other() {
        let a = segment_name("a");
        let ab = format!("{a}b");
        let bytes = (PAGE + 4096) as u64;
        let (x, _) = OwnedClientMemory::create(&a, 1, 0, 1, bytes).unwrap();
        let (y, _) = OwnedClientMemory::create(&ab, 1, 0, 1, bytes).unwrap();
        std::mem::forget(x);
        sweep(&a);
        assert!(ClientMemory::open_read_only(&a, 1, 0, 1, bytes).is_err());
        assert!(ClientMemory::open_read_only(&ab, 1, 0, 1, bytes).is_ok());
        drop(y);
    }

    #[test]
    fn a_descriptor_of_the_wrong_size_is_refused() {
        let seg = segment_name("size");
        let (own, fd) = OwnedClientMemory::create(&seg, 1, 0, 1, 8192).unwrap();
        assert!(matches!(
            ClientMemory::attach(fd, 12288),
            Err(Error::Truncated { .. })
        ));
        drop(own);
    }
}
