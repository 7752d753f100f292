//! A paged KV cache in host memory that a kvring server can map: what a
//! CPU-only engine (or a test, or the demo) allocates its KV cache in.
//!
//! All tensors live in one memfd, each at a page-aligned offset. The memfd
//! is sealed against shrinking before it is shared, so the server's mapping
//! can never fault because of the engine (the server refuses unsealed
//! memory). The engine reads and writes through raw pointers; the server
//! copies blocks in and out while the engine's own code runs, exactly as it
//! does with a GPU cache.

use crate::error::{Error, Result};
use crate::kv::pattern::Slabs;
use crate::kv::KvLayout;
use crate::proto::kv::TensorRegion;
use memmap2::{MmapOptions, MmapRaw};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// A host KV cache in a sealed memfd.
pub struct HostKvCache {
    layout: KvLayout,
    fd: OwnedFd,
    map: MmapRaw,
    stride: u64,
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
        let stride = round_page(layout.tensor_bytes());
        let total = stride
            .checked_mul(u64::from(layout.num_tensors()))
            .ok_or_else(|| Error::InvalidArgument("cache size overflows".into()))?;
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
            stride,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The memfd the server maps.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where each tensor lives in the memfd (for registration).
    pub fn regions(&self) -> Vec<TensorRegion> {
        (0..self.layout.num_tensors())
            .map(|i| TensorRegion {
                fd_index: 0,
                _reserved: 0,
                offset: u64::from(i) * self.stride,
            })
            .collect()
    }

    /// Address of slab (`layer`, `part`, `block`). Panics out of range.
    pub fn slab_ptr(&self, layer: u32, part: u32, block: u32) -> *mut u8 {
        let l = &self.layout;
        assert!(layer < l.num_layers && part < l.parts() && block < l.num_blocks);
        let (t, off) = l.slab_at(layer, part, block);
        let at = u64::from(t) * self.stride + off;
        assert!(at + l.slab_bytes() <= self.map.len() as u64);
        // SAFETY: in bounds of the mapping (checked above).
        unsafe { self.map.as_mut_ptr().add(at as usize) }
    }

    /// Writes one slab (`bytes` must be exactly one slab long).
    pub fn write_slab(&self, layer: u32, part: u32, block: u32, bytes: &[u8]) {
        assert_eq!(bytes.len() as u64, self.layout.slab_bytes());
        let p = self.slab_ptr(layer, part, block);
        // SAFETY: `p` addresses one slab inside our mapping; raw copy, no
        // reference to the shared memory is formed.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    }

    /// Copies one slab out.
    pub fn read_slab(&self, layer: u32, part: u32, block: u32, out: &mut [u8]) {
        assert_eq!(out.len() as u64, self.layout.slab_bytes());
        let p = self.slab_ptr(layer, part, block);
        // SAFETY: as in `write_slab`.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
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

impl Slabs for HostKvCache {
    fn slab_layout(&self) -> &KvLayout {
        self.layout()
    }
    fn put_slab(&self, layer: u32, part: u32, block: u32, bytes: &[u8]) {
        self.write_slab(layer, part, block, bytes)
    }
    fn get_slab(&self, layer: u32, part: u32, block: u32, out: &mut [u8]) {
        self.read_slab(layer, part, block, out)
    }
}
