//! The host backend: run-by-run copies between mapped engine memory and
//! the pool, done in `submit` with streaming stores ([`super::nt_copy`]),
//! or by cross-memory attach for memory in the engine's address space
//! ([`PeerMemory`]).

use super::backend::{Backend, BackendKind, ChunkCopy, CopyError, CopyExecutor};
use super::job::Dir;
use super::nt_copy;
use crate::peer_memory::{PeerMemory, Way};
use crate::refusal::Refusal;
use crate::registry::{DeviceMemory, DeviceOpener};
use kvring::kv::KvLayout;
use kvring::proto::kv::{KvAllocation, MemoryPiece, RegisterKv};
use std::os::fd::OwnedFd;

/// The host backend.
pub struct HostBackend;

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn executor(&self) -> Result<Box<dyn CopyExecutor>, CopyError> {
        Ok(Box::new(HostExecutor {
            done: Vec::new(),
            runs: RunBuffers::default(),
        }))
    }
}

impl DeviceOpener for HostBackend {
    fn open_device(
        &self,
        _slot: u32,
        _req: &RegisterKv,
        _layout: &KvLayout,
        _allocs: &[KvAllocation],
        _pieces: &[MemoryPiece],
        _fds: &[OwnedFd],
    ) -> Result<DeviceMemory, Refusal> {
        Err(Refusal::invalid(format!(
            "device memory needs the CUDA backend; this server copies with the {} backend (kvring serve --backend cuda)",
            self.name()
        )))
    }
}

struct HostExecutor {
    done: Vec<(usize, Result<u64, CopyError>)>,
    runs: RunBuffers,
}

impl CopyExecutor for HostExecutor {
    fn depth(&self) -> usize {
        1
    }

    fn submit(&mut self, c: &ChunkCopy<'_>, token: usize) -> Result<(), CopyError> {
        let r = host_copy(c, &mut self.runs);
        self.done.push((token, r));
        Ok(())
    }

    fn poll(&mut self, _wait: bool, out: &mut Vec<(usize, Result<u64, CopyError>)>) {
        out.append(&mut self.done);
    }
}

/// Runs gathered before each batch of streaming copies.
const BATCH: usize = 4096;

/// One executor's buffers of (destination, source) runs, per part, and for
/// cross-memory attach the rows, the bounce buffer and its iovecs with the
/// engine's (pairwise), kept between chunks so a copy allocates nothing
/// once they have grown.
#[derive(Default)]
pub(super) struct RunBuffers {
    parts: [Vec<(*mut u8, *const u8)>; 2],
    rows: Vec<PeerRow>,
    bounce: Vec<u8>,
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

/// The host copy of one chunk: the registration's runs ([`CopyPlan`]),
/// four at a time, streaming.
///
/// [`CopyPlan`]: kvring::kv::CopyPlan
pub(super) fn host_copy(c: &ChunkCopy<'_>, runs: &mut RunBuffers) -> Result<u64, CopyError> {
    // Device memory has no host mapping.
    if c.inst.host.is_empty() && c.inst.process.is_none() {
        return Err(CopyError::NotHostMemory);
    }
    let w = &c.word;
    let words = w.job.words();
    let (entry, g) = (w.job.entry, w.job.generation);
    // Entered before `cancel` is read: a client that gives the job up
    // either stops this copy or sees it under way and waits for `leave`.
    let r = if words.enter(entry, g, w.worker, w.seq) {
        match &c.inst.process {
            Some(p) => copy_peer_runs(c, p, runs),
            None => copy_runs(c, runs),
        }
    } else {
        Ok(0)
    };
    words.leave(entry, w.worker, w.seq);
    r
}

/// The runs of one chunk, copied.
fn copy_runs(c: &ChunkCopy<'_>, runs: &mut RunBuffers) -> Result<u64, CopyError> {
    let inst = c.inst;
    let (l, plan) = (&inst.layout, &inst.plan);
    let pieces = &mut runs.parts;
    let mut moved = 0u64;
    let flush = |pieces: &mut [Vec<(*mut u8, *const u8)>; 2]| {
        for (part, p) in pieces.iter_mut().enumerate() {
            // SAFETY: every piece is a run inside a live mapping and the
            // object (below); destinations are distinct runs of one object
            // (store: the plan tiles it) or of the engine's cache (retrieve:
            // block ids are distinct, checked at acceptance, and the layout
            // was proven free of overlapping rows at registration), and a
            // pool object never overlaps engine memory. The engine's memory
            // may change under the copy (its bytes are the engine's
            // business) but cannot shrink (sealed), so no access faults.
            // Raw pointers only: no reference to shared memory is formed.
            unsafe { nt_copy::copy_pieces(p, plan.width[part] as usize) };
            p.clear();
        }
    };
    for layer in c.layers.clone() {
        let base = inst.host[l.layers()[layer as usize].alloc as usize].ptr();
        for (j, &block) in c.blocks.iter().enumerate().skip(c.skip_blocks as usize) {
            plan.for_each_run(
                l,
                c.chunk_tokens,
                layer,
                block,
                j as u32,
                |part, eng, obj, n| {
                    // SAFETY: `block < num_blocks` was checked when the job was
                    // accepted and the layout was validated at registration
                    // against the allocation's mapped size, so the run lies
                    // inside the mapping; the object run lies inside the pool
                    // range the cache allocated for `object_bytes` (the plan
                    // tiles the object). Only addresses here.
                    let (e, o) = unsafe { (base.add(eng as usize), c.object.add(obj as usize)) };
                    pieces[part as usize].push(match c.dir {
                        Dir::ToPool => (o, e as *const u8),
                        Dir::FromPool => (e, o as *const u8),
                    });
                    moved += n;
                },
            );
        }
        if pieces[0].len() + pieces[1].len() >= BATCH {
            flush(pieces);
        }
    }
    flush(pieces);
    // The streaming stores land before the job's completion is published
    // (a Release store after this returns).
    nt_copy::fence();
    Ok(moved)
}

/// The runs of one chunk, moved by cross-memory attach through a bounce
/// buffer: the engine-side runs, sorted by address, are merged into spans
/// (a page of a token-major layout is one or two spans however its rows
/// interleave in the object), the kernel moves whole spans between the
/// engine and the bounce buffer, and the rows are gathered or scattered
/// here. A span is exactly the union of its rows (runs never overlap: the
/// layout was proven so at registration), so a write touches no engine
/// byte outside the chunk's rows. One iovec a row instead (the kernel
/// pins pages per iovec, at most 1,024 a call) loaded SGLang's 2 MiB
/// pages of 256-byte rows at 1.2 GB/s on the 2-core VM, against 1.8-2.2
/// GB/s this way.
fn copy_peer_runs(
    c: &ChunkCopy<'_>,
    peer: &PeerMemory,
    runs: &mut RunBuffers,
) -> Result<u64, CopyError> {
    let inst = c.inst;
    let (l, plan) = (&inst.layout, &inst.plan);
    let rows = &mut runs.rows;
    rows.clear();
    let mut moved = 0u64;
    for layer in c.layers.clone() {
        let (base, _) = peer.window(l.layers()[layer as usize].alloc as usize);
        for (j, &block) in c.blocks.iter().enumerate().skip(c.skip_blocks as usize) {
            plan.for_each_run(
                l,
                c.chunk_tokens,
                layer,
                block,
                j as u32,
                |_, eng, obj, n| {
                    // Inside the allocation's window (validated layout, block
                    // checked at acceptance), which lies in the address space.
                    rows.push(PeerRow {
                        remote: base + eng,
                        object: obj,
                        len: n,
                    });
                    moved += n;
                },
            );
        }
    }
    rows.sort_unstable_by_key(|r| r.remote);
    let (spans_local, spans_remote) = (&mut runs.local, &mut runs.remote);
    spans_local.clear();
    spans_remote.clear();
    let bounce = &mut runs.bounce;
    bounce.resize(moved as usize, 0);
    let mut at = 0usize;
    for r in rows.iter() {
        let n = r.len as usize;
        let local = bounce[at..].as_mut_ptr();
        let remote = r.remote as *mut u8;
        match (spans_local.last_mut(), spans_remote.last_mut()) {
            (Some(l0), Some(r0)) if r0.iov_base.cast::<u8>().wrapping_add(r0.iov_len) == remote => {
                l0.iov_len += n;
                r0.iov_len += n;
            }
            _ => {
                spans_local.push(libc::iovec {
                    iov_base: local.cast(),
                    iov_len: n,
                });
                spans_remote.push(libc::iovec {
                    iov_base: remote.cast(),
                    iov_len: n,
                });
            }
        }
        at += n;
    }
    match c.dir {
        Dir::ToPool => {
            peer.transfer(Way::Read, spans_local, spans_remote)?;
            each_row(rows, bounce, c.object, |object, b| {
                // SAFETY: `object` is `b.len()` bytes of this chunk's pool
                // object, which this copy alone writes; the bounce buffer is
                // this executor's own.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), object, b.len()) }
            });
        }
        Dir::FromPool => {
            each_row(rows, bounce, c.object, |object, b| {
                // SAFETY: `object` is `b.len()` bytes of a committed pool
                // object, held for this retrieve (nobody writes it).
                unsafe {
                    std::ptr::copy_nonoverlapping(object as *const u8, b.as_mut_ptr(), b.len())
                }
            });
            // Given up while the rows were gathered (a server stopped
            // there and resumed): nothing is written. This leaves a
            // client that gave up a write only the instructions between
            // here and the system call to find under way.
            let w = &c.word;
            if w.job.words().cancelled(w.job.entry, w.job.generation) {
                return Ok(0);
            }
            peer.transfer(Way::Write, spans_local, spans_remote)?;
        }
    }
    Ok(moved)
}

/// `f(row in the object, its bytes in the bounce buffer)` for each row:
/// rows and the bounce buffer are in the same (engine address) order.
fn each_row(
    rows: &[PeerRow],
    bounce: &mut [u8],
    object: *mut u8,
    mut f: impl FnMut(*mut u8, &mut [u8]),
) {
    let mut at = 0usize;
    for r in rows {
        let n = r.len as usize;
        // SAFETY: the object run lies inside the pool range allocated for
        // this chunk at `object` (the plan tiles the object). Only an address.
        let o = unsafe { object.add(r.object as usize) };
        f(o, &mut bounce[at..at + n]);
        at += n;
    }
}

/// One row of a chunk in engine memory (`remote`) and in its object.
#[derive(Clone, Copy)]
pub(super) struct PeerRow {
    remote: u64,
    object: u64,
    len: u64,
}
