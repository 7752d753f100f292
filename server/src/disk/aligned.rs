//! A buffer for direct I/O: its address and length are multiples of the
//! block ([`BLOCK`]), as `O_DIRECT` requires of every transfer.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// The unit of direct I/O: offsets, lengths and addresses are multiples of
/// it (4 KiB covers every logical block size in use).
pub const BLOCK: usize = 4096;

/// `n` rounded up to a multiple of [`BLOCK`].
pub const fn round_up(n: u64) -> u64 {
    n.div_ceil(BLOCK as u64) * BLOCK as u64
}

/// Zeroed heap memory, [`BLOCK`]-aligned, a whole number of blocks long.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation outright (no aliasing pointer is
// kept anywhere), like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; shared access is read-only through `Deref`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to whole
    /// blocks; at least one).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let len = round_up(len.max(1) as u64) as usize;
        let layout = Layout::from_size_align(len, BLOCK).expect("a block-aligned layout");
        // SAFETY: the layout's size is nonzero (at least one block).
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialized (zeroed) bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, BLOCK).expect("the layout it was made with");
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_whole_aligned_blocks() {
        for n in [0, 1, 4095, 4096, 4097, 3 << 20] {
            let b = AlignedBuf::zeroed(n);
            assert_eq!(b.as_ptr() as usize % BLOCK, 0);
            assert_eq!(b.len() % BLOCK, 0);
            assert!(b.len() >= n.max(1) && b.len() < n.max(1) + BLOCK);
            assert!(b.iter().all(|&x| x == 0));
        }
    }
}
