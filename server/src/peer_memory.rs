//! Memory in an engine process's own address space (memory kind
//! `process_vm`): a KV cache the engine could not put in a memfd (vLLM's
//! CPU cache is one ordinary torch buffer), copied with cross-memory attach
//! (`process_vm_readv` / `process_vm_writev`), so neither side copies it
//! twice.
//!
//! The process is the one on the other end of the registering connection:
//! its pid comes from `SO_PEERCRED` and is held as a pidfd from connect,
//! never from a word the client sends. Every copy checks the pidfd first: a
//! pid is reused only after its process was reaped, so the window is that
//! between the check and the system call. An address the engine has
//! unmapped since registering fails that copy (`EFAULT`, or a short count
//! when it goes under the copy; the kernel checks every page); the server
//! never faults. Unregistering, or the client going, revokes the memory:
//! the revocation waits for copies under way and no copy starts after it,
//! so the engine may free the memory once its unregister is answered.

use super::refusal::Refusal;
use kvring::liveness::PidFd;
use kvring::proto::kv::KvAllocation;
use std::sync::RwLock;

/// Most (local, remote) pairs in one system call (`IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Which way bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// From the engine's memory into the server's (a store).
    Read,
    /// From the server's memory into the engine's (a retrieve).
    Write,
}

/// Why a copy to or from an engine process failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerCopyError {
    #[error("the engine process {0} has exited")]
    Exited(u32),
    #[error("the engine's memory was unregistered")]
    Revoked,
    #[error("engine process {pid}: {source}")]
    Os { pid: u32, source: std::io::Error },
    #[error(
        "engine process {pid}: {moved} of {wanted} bytes moved (memory unmapped under the copy)"
    )]
    Short {
        pid: u32,
        moved: usize,
        wanted: usize,
    },
}

/// One engine process's registered allocations.
pub struct PeerMemory {
    pid: u32,
    pidfd: PidFd,
    /// Each allocation's (address, bytes) in the engine process.
    windows: Vec<(u64, u64)>,
    /// Set once unregistered; copies hold it shared while they run, so the
    /// revocation (exclusive) waits for them.
    revoked: RwLock<bool>,
}

impl PeerMemory {
    /// The allocations `allocs` (addresses in `offset`) of process `pid`,
    /// known by `pidfd` since it connected. Refused when the process has
    /// exited, when the server may not access its memory, or when an
    /// allocation's first or last byte is not mapped there.
    pub fn open(pid: u32, pidfd: PidFd, allocs: &[KvAllocation]) -> Result<PeerMemory, Refusal> {
        let mem = PeerMemory {
            pid,
            pidfd,
            windows: allocs.iter().map(|a| (a.offset, a.bytes)).collect(),
            revoked: RwLock::new(false),
        };
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(|e| Refusal::invalid(format!("the mappings of process {pid}: {e}")))?;
        for (i, &(addr, bytes)) in mem.windows.iter().enumerate() {
            if bytes == 0 || addr == 0 || addr.checked_add(bytes).is_none() {
                return Err(Refusal::invalid(format!(
                    "allocation {i}: [{addr:#x}, +{bytes}) is not an address range"
                )));
            }
            check_backing(&maps, addr, addr + bytes)
                .map_err(|why| Refusal::invalid(format!("allocation {i}: {why}")))?;
            for at in [addr, addr + bytes - 1] {
                let mut byte = 0u8;
                let local = [libc::iovec {
                    iov_base: (&mut byte as *mut u8).cast(),
                    iov_len: 1,
                }];
                let remote = [libc::iovec {
                    iov_base: at as *mut libc::c_void,
                    iov_len: 1,
                }];
                mem.transfer(Way::Read, &local, &remote).map_err(|e| {
                    Refusal::invalid(format!(
                        "allocation {i}: byte {at:#x} of the registering process: {}",
                        explain(&e)
                    ))
                })?;
            }
        }
        Ok(mem)
    }

    /// No copy starts after this returns, and none is under way: the
    /// memory is the engine's again. (Waits for copies in progress: each
    /// is one chunk.)
    pub fn revoke(&self) {
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Allocation `i`'s address in the engine process and its size.
    pub fn window(&self, i: usize) -> (u64, u64) {
        self.windows[i]
    }

    /// Moves `local[i]` (server memory) to or from `remote[i]` (engine
    /// addresses), the `way` given, up to `IOV_MAX` of each per system
    /// call; `local[i]` and `remote[i]` have the same length. The caller
    /// keeps every server range valid and every engine range inside a
    /// window.
    pub fn transfer(
        &self,
        way: Way,
        local: &[libc::iovec],
        remote: &[libc::iovec],
    ) -> Result<(), PeerCopyError> {
        debug_assert_eq!(local.len(), remote.len());
        // Held until the copy is over: a revocation waits for it.
        let revoked = self.revoked.read().unwrap_or_else(|e| e.into_inner());
        if *revoked {
            return Err(PeerCopyError::Revoked);
        }
        if self.pidfd.exited() {
            return Err(PeerCopyError::Exited(self.pid));
        }
        let call = match way {
            Way::Read => libc::process_vm_readv,
            Way::Write => libc::process_vm_writev,
        };
        for (l, r) in local.chunks(IOV_MAX).zip(remote.chunks(IOV_MAX)) {
            let wanted: usize = l.iter().map(|v| v.iov_len).sum();
            // SAFETY: `l` names server memory the caller keeps valid and
            // unshared for the call (pool objects of this chunk, or a stack
            // byte); the kernel checks every remote page against the
            // engine's mappings and fails rather than touch anything else.
            // Both arrays hold `l.len()` iovecs.
            let moved = unsafe {
                call(
                    self.pid as libc::pid_t,
                    l.as_ptr(),
                    l.len() as libc::c_ulong,
                    r.as_ptr(),
                    r.len() as libc::c_ulong,
                    0,
                )
            };
            if moved < 0 {
                return Err(PeerCopyError::Os {
                    pid: self.pid,
                    source: std::io::Error::last_os_error(),
                });
            }
            if moved as usize != wanted {
                return Err(PeerCopyError::Short {
                    pid: self.pid,
                    moved: moved as usize,
                    wanted,
                });
            }
        }
        Ok(())
    }
}

/// Checks that `[start, end)` lies in mappings of `maps` (a
/// `/proc/PID/maps` text) that no file system serves: anonymous memory
/// (the heap, a stack, `mmap` of nothing) or shared memory (memfds,
/// `/dev/shm`, System V). A page fault in a file another process serves
/// (FUSE, a network file system) could block the server's copy for as long
/// as that process likes.
fn check_backing(maps: &str, start: u64, end: u64) -> Result<(), String> {
    let mut at = start;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(_perms), Some(_off), Some(_dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path = f.collect::<Vec<_>>().join(" ");
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at {
            break;
        }
        // `/dev/zero (deleted)`: an anonymous shared mapping (mmap of
        // MAP_SHARED | MAP_ANONYMOUS, as SGLang's host pool is), which
        // shared memory backs, not the device file it is named after.
        let shared_memory = path.starts_with("/memfd:")
            || path.starts_with("/dev/shm/")
            || path.starts_with("/SYSV")
            || path == "/dev/zero (deleted)";
        if inode != "0" && !shared_memory {
            return Err(format!(
                "bytes {at:#x}.. are a mapping of the file {path}: only anonymous or shared memory can be registered by address"
            ));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    Err(format!(
        "byte {at:#x} is not mapped in the registering process"
    ))
}

/// What a failed access at registration means, in the engine's terms.
fn explain(e: &PeerCopyError) -> String {
    match e {
        PeerCopyError::Os { source, .. } if source.raw_os_error() == Some(libc::EPERM) => format!(
            "{source}: the server may not access this process's memory (same user needed; \
             a non-dumpable process, or Yama ptrace_scope 2 or 3, forbid it; under ptrace_scope 1 \
             the client library names the server with prctl(PR_SET_PTRACER))"
        ),
        PeerCopyError::Os { source, .. } if source.raw_os_error() == Some(libc::EFAULT) => {
            format!("{source}: not mapped")
        }
        PeerCopyError::Os { source, .. } if source.raw_os_error() == Some(libc::ENOSYS) => {
            format!("{source}: this kernel has no cross-memory attach (CONFIG_CROSS_MEMORY_ATTACH)")
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::check_backing;

    /// Mappings as `/proc/PID/maps` lists them.
    const MAPS: &str = "\
7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n\
7f0000100000-7f0000200000 rw-s 00000000 00:01 4711                       /dev/zero (deleted)\n\
7f0000200000-7f0000300000 rw-s 00000000 00:01 4712                       /memfd:kv (deleted)\n\
7f0000300000-7f0000400000 rw-s 00000000 00:19 99                         /dev/shm/kv\n\
7f0000400000-7f0000500000 rw-p 00000000 08:01 123                        /data/weights.bin\n";

    #[test]
    fn anonymous_and_shared_memory_are_accepted() {
        // Private anonymous memory, an anonymous shared mapping (SGLang's
        // host pool: mmap MAP_SHARED | MAP_ANONYMOUS), a memfd, /dev/shm.
        check_backing(MAPS, 0x7f00_0000_0000, 0x7f00_0040_0000).unwrap();
        check_backing(MAPS, 0x7f00_0010_0000, 0x7f00_0020_0000).unwrap();
    }

    #[test]
    fn a_file_or_a_hole_is_refused() {
        let e = check_backing(MAPS, 0x7f00_0038_0000, 0x7f00_0041_0000).unwrap_err();
        assert!(e.contains("/data/weights.bin"), "{e}");
        let e = check_backing(MAPS, 0x7f00_0060_0000, 0x7f00_0070_0000).unwrap_err();
        assert!(e.contains("not mapped"), "{e}");
    }
}
