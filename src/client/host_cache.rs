//! A paged KV cache in host memory that a kvring server can map: what a
//! CPU-only engine (or a test, or the demo) allocates its KV cache in.
//!
//! Every allocation of the layout lives in one memfd, each at a
//! page-aligned offset. The memfd is sealed against shrinking before it is
//! shared, so the server's mapping can never fault because of the engine
//! (the server refuses unsealed memory). The engine reads and writes
//! through raw pointers; the server copies blocks in and out while the
//! engine's own code runs, exactly as it does with a GPU cache.

use super::registration::Memory;
use crate::error::{Error, Result};
use crate::kv::pattern::{KvMemory, Run};
use crate::kv::KvLayout;
use memmap2::{MmapOptions, MmapRaw};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// A host KV cache in a sealed memfd.
pub struct HostKvCache {
    layout: KvLayout,
    fd: OwnedFd,
    map: MmapRaw,
    /// Where each allocation starts in the memfd.
    offsets: Vec<u64>,
}

// SAFETY: the mapping is plain shared memory accessed through raw pointers
// with explicit bounds; the struct owns it.
unsafe impl Send for HostKvCache {}
// SAFETY: as above; concurrent byte access is the caller's (and server's)
// business, never a Rust reference.
unsafe impl Sync for HostKvCache {}

fn round_page(v: u64) -> u64 {
    v.div_ceil(crate::shm::PAGE as u64) * crate::shm::PAGE as u64
}

impl HostKvCache {
    /// Allocates a zeroed cache for `layout` (`chunk_tokens`: the server's
    /// chunk size, which the block size must divide).
    pub fn new(layout: KvLayout, chunk_tokens: u32) -> Result<HostKvCache> {
        layout
            .validate(chunk_tokens)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut offsets = Vec::with_capacity(layout.allocations().len());
        let mut total = 0u64;
        for &bytes in layout.allocations() {
            offsets.push(total);
            total = total
                .checked_add(round_page(bytes))
                .ok_or_else(|| Error::InvalidArgument("cache size overflows".into()))?;
        }
        let fd = nix::sys::memfd::memfd_create(
            c"kvring-kv-cache",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(crate::error::nix("memfd_create"))?;
        nix::unistd::ftruncate(&fd, total as i64)
            .map_err(crate::error::nix("size the KV cache"))?;
        // SAFETY: F_ADD_SEALS on our own memfd; it only adds seals.
        let r = unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
            )
        };
        if r != 0 {
            return Err(crate::error::io("seal the KV cache")(
                std::io::Error::last_os_error(),
            ));
        }
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw(&fd)
            .map_err(crate::error::io("map the KV cache"))?;
        Ok(HostKvCache {
            layout,
            fd,
            map,
            offsets,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The memfd the server maps.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where each allocation lives in the memfd (for registration).
    pub fn memory(&self) -> Memory {
        Memory::host(self.offsets.iter().map(|&o| (0, o)))
    }

    /// Address of byte `offset` of allocation `alloc`, checked to leave
    /// `bytes` bytes inside it. Panics out of range.
    pub fn at(&self, alloc: u32, offset: u64, bytes: u64) -> *mut u8 {
        let size = self.layout.allocations()[alloc as usize];
        assert!(offset.checked_add(bytes).is_some_and(|e| e <= size));
        let at = self.offsets[alloc as usize] + offset;
        // SAFETY: in bounds of the mapping (allocations are laid out in it
        // by `offsets`, each at least its size).
        unsafe { self.map.as_mut_ptr().add(at as usize) }
    }

    /// Fills every byte of the cache with `byte` (e.g. to poison it).
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole mapping, raw.
        unsafe { std::ptr::write_bytes(self.map.as_mut_ptr(), byte, self.map.len()) };
    }

    /// Bytes of the whole cache.
    pub fn bytes(&self) -> u64 {
        self.map.len() as u64
    }
}

impl KvMemory for HostKvCache {
    fn kv_layout(&self) -> &KvLayout {
        self.layout()
    }

    fn write_runs(&self, runs: &[Run], src: &[u8]) {
        for r in runs {
            let from = &src[r.at as usize..][..r.bytes as usize];
            let p = self.at(r.alloc, r.offset, r.bytes);
            // SAFETY: `p` addresses `r.bytes` bytes inside our mapping
            // (checked by `at`); raw copy, no reference to the shared memory
            // is formed.
            unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), p, from.len()) };
        }
    }

    fn read_runs(&self, runs: &[Run], dst: &mut [u8]) {
        for r in runs {
            let to = &mut dst[r.at as usize..][..r.bytes as usize];
            let p = self.at(r.alloc, r.offset, r.bytes);
            // SAFETY: as in `write_runs`.
            unsafe { std::ptr::copy_nonoverlapping(p, to.as_mut_ptr(), to.len()) };
        }
    }
}
