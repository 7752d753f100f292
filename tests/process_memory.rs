//! KV caches in an engine's ordinary process memory (memory kind
//! `process_vm`: a heap buffer, as vLLM's CPU cache is one torch buffer),
//! served by the real `kvring` binary through cross-memory attach: bytes
//! round trip exactly, from an address that is not page-aligned; an
//! address that is not mapped is refused at registration; memory unmapped
//! after registering fails that job, and the server goes on serving.

mod common;

use common::*;
use kvring::client::Memory;
use kvring::jobs::{FailReason, JobStatus};
use kvring::kv::pattern::{self, KvMemory, Run};
use kvring::kv::{model_id, KvLayout, LayoutPreset};
use kvring::{Error, KvSpec, Lookup, Retrieve, Store};
use std::cell::UnsafeCell;
use std::time::Duration;

/// A KV cache in a plain heap buffer, starting `skew` bytes past a
/// 64-byte boundary (as torch's CPU allocator hands out memory).
struct HeapCache {
    layout: KvLayout,
    buf: UnsafeCell<Vec<u8>>,
    skew: usize,
}

impl HeapCache {
    fn new(layout: KvLayout, skew: usize) -> HeapCache {
        let bytes = layout.allocations()[0] as usize;
        HeapCache {
            layout,
            buf: UnsafeCell::new(vec![0u8; bytes + skew]),
            skew,
        }
    }

    fn addr(&self) -> u64 {
        // SAFETY: only the vector's address is read.
        unsafe { (&*self.buf.get()).as_ptr() as u64 + self.skew as u64 }
    }

    fn poison(&self, byte: u8) {
        // SAFETY: no copy of the server's runs while the test writes.
        unsafe { (&mut *self.buf.get())[self.skew..].fill(byte) }
    }
}

impl KvMemory for HeapCache {
    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }
    fn write_runs(&self, runs: &[Run], src: &[u8]) {
        // SAFETY: the server copies only while a job runs, and the test
        // writes between jobs.
        let buf = unsafe { &mut *self.buf.get() };
        for r in runs {
            let at = self.skew + r.offset as usize;
            buf[at..at + r.bytes as usize]
                .copy_from_slice(&src[r.at as usize..][..r.bytes as usize]);
        }
    }
    fn read_runs(&self, runs: &[Run], dst: &mut [u8]) {
        // SAFETY: as in `write_runs`.
        let buf = unsafe { &*self.buf.get() };
        for r in runs {
            let at = self.skew + r.offset as usize;
            dst[r.at as usize..][..r.bytes as usize]
                .copy_from_slice(&buf[at..at + r.bytes as usize]);
        }
    }
}

#[test]
fn kv_in_the_engines_own_memory_round_trips_byte_for_byte() {
    let s = Fixture::new("procmem", Duration::from_secs(30), &KV_SERVER_ARGS);
    let mut c = s.client();
    for preset in [LayoutPreset::Lbnhc, LayoutPreset::Lbhnc] {
        let cache = HeapCache::new(kv_layout(preset, 2, 64, 24), 64);
        let spec = KvSpec::new(model_id(MODEL), 1, 0);
        let reg = c
            .register(&spec, &cache.layout, &Memory::process([cache.addr()]), &[])
            .unwrap();
        let bpc = reg.blocks_per_chunk();
        let hashes = prompt_hashes(31 + preset as u32, 3);
        let blocks: Vec<u32> = (0..3 * bpc).map(|k| (k * 5 + 1) % 64).collect();
        for (h, b) in hashes.iter().zip(blocks.chunks(bpc as usize)) {
            pattern::write_chunk(&cache, 0, h, b);
        }
        let r = done(c.store(Store::new(&reg, &hashes, &blocks)).unwrap());
        assert_eq!(r.value, 3, "{preset:?}: chunks stored");
        cache.poison(0x5a);
        let lease = c.lookup(Lookup::new(model_id(MODEL), 1, &hashes)).unwrap();
        assert_eq!(lease.hits(), 3);
        let fresh: Vec<u32> = (0..3 * bpc).map(|k| (k * 3 + 2) % 64).collect();
        done(c.retrieve(Retrieve::new(&reg, &lease, &fresh)).unwrap());
        for (i, (h, b)) in hashes.iter().zip(fresh.chunks(bpc as usize)).enumerate() {
            if let Err(e) = pattern::verify_chunk(&cache, 0, h, b, 0, 0x5a) {
                panic!("{preset:?} chunk {i}: {e}");
            }
        }
        drop(lease);
        c.unregister(reg).unwrap();
        c.clear().unwrap();
    }
}

#[test]
fn unmapped_memory_is_refused_at_registration_and_fails_a_copy_not_the_server() {
    let s = Fixture::new("procmem-unmapped", Duration::from_secs(30), &KV_SERVER_ARGS);
    let mut c = s.client();
    let layout = kv_layout(LayoutPreset::Lbnhc, 2, 64, 24);
    let bytes = layout.allocations()[0] as usize;
    let page = 4096usize;
    let len = bytes.div_ceil(page) * page;
    // SAFETY: a fresh private anonymous mapping, unmapped below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let spec = KvSpec::new(model_id(MODEL), 1, 0);

    // The last page unmapped: the allocation's last byte is not there.
    // SAFETY: the tail page of our own mapping.
    unsafe { libc::munmap(base.cast::<u8>().add(len - page).cast(), page) };
    match c.register(&spec, &layout, &Memory::process([base as u64]), &[]) {
        Err(Error::Registration { reason, .. }) => {
            assert!(reason.contains("not mapped"), "{reason}")
        }
        other => panic!("registration of unmapped memory: {other:?}"),
    }

    // A file's mapping: a page fault there is the file system's to serve
    // (FUSE, NFS could block the server), so it is refused.
    let path = s.dir.join("kv-file");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.set_len(len as u64).unwrap();
    // SAFETY: a shared mapping of our own file, unmapped below.
    let fm = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    assert_ne!(fm, libc::MAP_FAILED);
    match c.register(&spec, &layout, &Memory::process([fm as u64]), &[]) {
        Err(Error::Registration { reason, .. }) => {
            assert!(reason.contains("mapping of the file"), "{reason}")
        }
        other => panic!("registration of a file's mapping: {other:?}"),
    }
    // SAFETY: our own mapping, not used again.
    unsafe { libc::munmap(fm, len) };

    // A whole small cache, registered, then its memory unmapped: the
    // store fails `copy_failed`, the server still answers.
    let small = small_layout();
    // SAFETY: a fresh private anonymous mapping.
    let m = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            small.allocations()[0] as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(m, libc::MAP_FAILED);
    let reg = c
        .register(&spec, &small, &Memory::process([m as u64]), &[])
        .unwrap();
    // SAFETY: our own mappings; nothing of the test reads them afterwards.
    // The cache's pages are replaced in one call by a PROT_NONE mapping (its
    // contents gone, as unmapped): a plain munmap would free the address for
    // another test thread's allocation, which the copy would then read.
    unsafe {
        let gone = libc::mmap(
            m,
            small.allocations()[0] as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
        assert_eq!(gone, m);
        libc::munmap(base, len - page);
    }
    let hashes = prompt_hashes(41, 1);
    let blocks: Vec<u32> = (0..reg.blocks_per_chunk()).collect();
    let job = c.store(Store::new(&reg, &hashes, &blocks)).unwrap();
    assert_eq!(
        job.wait(far()).unwrap(),
        JobStatus::Failed(FailReason::CopyFailed)
    );
    drop(job);
    assert_eq!(c.ping(b"still here", far()).unwrap(), b"still here");
    let lease = c.lookup(Lookup::new(model_id(MODEL), 1, &hashes)).unwrap();
    assert_eq!(lease.hits(), 0, "a failed store commits nothing");
    // SAFETY: the PROT_NONE mapping made above, no longer registered-to.
    unsafe { libc::munmap(m, small.allocations()[0] as usize) };
}

#[test]
fn an_unregistered_cache_is_never_written_again() {
    let s = Fixture::new("procmem-revoke", Duration::from_secs(60), &KV_SERVER_ARGS);
    let mut c = s.client();
    let cache = HeapCache::new(kv_layout(LayoutPreset::Lbnhc, 2, 512, 64), 0);
    let spec = KvSpec::new(model_id(MODEL), 1, 0);
    let reg = c
        .register(&spec, &cache.layout, &Memory::process([cache.addr()]), &[])
        .unwrap();
    let bpc = reg.blocks_per_chunk();
    let chunks = 120;
    let hashes = prompt_hashes(51, chunks);
    let blocks: Vec<u32> = (0..chunks as u32 * bpc).collect();
    for (h, b) in hashes.iter().zip(blocks.chunks(bpc as usize)) {
        pattern::write_chunk(&cache, 0, h, b);
    }
    done(c.store(Store::new(&reg, &hashes, &blocks)).unwrap());
    let lease = c.lookup(Lookup::new(model_id(MODEL), 1, &hashes)).unwrap();
    cache.poison(0x5a);
    // A long retrieve, then the cache unregistered at once: once the
    // unregister is answered, the memory is the engine's again.
    let job = c.retrieve(Retrieve::new(&reg, &lease, &blocks)).unwrap();
    c.unregister(reg).unwrap();
    // SAFETY: a read of the test's own buffer; no copy may run now.
    let after_unregister = unsafe { (&*cache.buf.get()).clone() };
    let st = job.wait(far()).unwrap();
    assert!(
        matches!(
            st,
            JobStatus::Done(_) | JobStatus::Failed(FailReason::CopyFailed)
        ),
        "{st:?}"
    );
    // SAFETY: as above.
    let now = unsafe { &*cache.buf.get() };
    assert!(
        *now == after_unregister,
        "the server wrote the engine's memory after it was unregistered ({st:?})"
    );
}
