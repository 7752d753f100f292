//! The disk store: chunk objects in segment files under one directory,
//! found through an index in memory, kept within a byte budget by dropping
//! the oldest segment whole (objects go to disk when the pool evicts them,
//! so the oldest segment holds what was evicted longest ago).
//!
//! One server owns a directory at a time: a lock file (`kvring-disk.lock`,
//! an OFD lock the kernel drops when the server dies) refuses a second.
//! A server started on a directory that holds segments serves what they
//! hold: each segment's index is read (written when the segment took its
//! last record), or, for a segment without one that passes its checks
//! (a crash came first), its record headers (one block per record, in
//! file order); new records go to a new segment. Every read
//! checks the value against the key it was asked under (its key digest,
//! size and seal): a torn, truncated, foreign or swapped record is a miss,
//! counted, and leaves the index.
//!
//! Puts and gets come in batches ([`DiskStore::put_many`],
//! [`DiskStore::get_many`]) that keep up to the I/O's depth of transfers
//! in flight and do each object's pass on the CPU (sealing it before its
//! write, checking it after its read) while the others' transfers run. An
//! object in memory that is block-aligned is written from, and read into,
//! where it is: only a last partial block goes through a buffer of the
//! store's. A read's bytes land in the destination before their seal is
//! checked: a get that misses leaves the destination's contents undefined.

use super::aligned::{round_up, AlignedBuf, BLOCK};
use super::io::{self as disk_io, DiskIo, Done, IoOp, Way};
use super::segment::{self, Record, Segment};
use crate::l2::value::{self, Seal, Value, HEADER};
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// Where an object is: its segment's id and its record there.
#[derive(Clone, Copy, Debug)]
struct Loc {
    seg: u64,
    rec: Record,
}

/// The store's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// Objects in the index.
    pub objects: u64,
    /// Segment files, and their bytes.
    pub segments: u64,
    pub segment_bytes: u64,
    pub written: u64,
    pub read: u64,
    pub missed: u64,
    /// Records that did not open under their key, or failed their seal.
    pub corrupt: u64,
    /// Objects dropped with the oldest segment.
    pub evicted: u64,
    /// Segments whose records were found through their index when the
    /// store was opened (the others' headers were scanned).
    pub indexed_segments: u64,
}

/// Transfers in flight when the store is opened with [`DiskStore::open`].
pub const QUEUE_DEPTH: usize = 4;

/// One object of a [`DiskStore::get_many`]: `key`'s object of `len`
/// bytes, read into `dst` (as long).
pub struct Get<'a> {
    pub key: &'a str,
    pub len: u64,
    pub dst: &'a mut [u8],
}

/// The store's buffers for one transfer: the header block, and what of
/// the object cannot go straight to or from the caller's memory.
struct Slot {
    head: AlignedBuf,
    body: AlignedBuf,
}

/// Where a transfer's object bytes are in memory.
#[derive(Clone, Copy)]
enum Body {
    /// The caller's memory for the first `whole` bytes (whole blocks of
    /// a block-aligned object), the slot's buffer for the rest (less
    /// than a block, padded).
    Direct { whole: usize },
    /// The slot's buffer for all of it.
    Copied,
}

impl Body {
    /// How an object of `len` bytes at `ptr` goes.
    fn of(ptr: *const u8, len: usize) -> Body {
        let whole = len / BLOCK * BLOCK;
        if (ptr as usize) % BLOCK == 0 && whole > 0 {
            Body::Direct { whole }
        } else {
            Body::Copied
        }
    }

    /// `op` with the object's buffers: `obj` (the caller's, `len` bytes)
    /// or `slot`'s.
    fn bufs(self, op: IoOp, obj: *const u8, len: usize, slot: &Slot) -> IoOp {
        match self {
            Body::Direct { whole } if whole == len => op.buf(obj, whole),
            Body::Direct { whole } => op.buf(obj, whole).buf(slot.body.as_ptr(), BLOCK),
            Body::Copied => op.buf(slot.body.as_ptr(), round_up(len as u64) as usize),
        }
    }
}

/// A put whose object is sealed, waiting for its turn to be written.
struct ReadyPut {
    item: usize,
    digest: [u8; 16],
    slot: usize,
    body: Body,
}

/// A put being written.
struct PutInFlight {
    item: usize,
    digest: [u8; 16],
    loc: Loc,
    bytes: usize,
}

/// A get being read (or waiting to be).
struct GetInFlight {
    item: usize,
    digest: [u8; 16],
    loc: Loc,
    body: Body,
    bytes: usize,
}

/// A store in a directory of its own.
pub struct DiskStore {
    /// First, so that it is dropped first: its drop waits for whatever is
    /// in flight, which may use the slots below.
    io: Box<dyn DiskIo>,
    /// `io.depth() + 1` (one more than in flight: the transfer whose end
    /// is being handled while the next runs).
    slots: Vec<Slot>,
    dir: PathBuf,
    seal: Seal,
    /// Bytes of each segment file.
    segment_bytes: u64,
    /// Most segments kept (the budget over the segment size).
    max_segments: usize,
    /// Oldest first; new records go to the last.
    segments: VecDeque<Segment>,
    index: HashMap<[u8; 16], Loc>,
    next_id: u64,
    /// The first id this start gave a segment: older ones are read-only.
    own_from: u64,
    stats: DiskStats,
    _lock: File,
}

/// The lock file of a store's directory.
pub const LOCK_FILE: &str = "kvring-disk.lock";

impl DiskStore {
    /// Opens the store in `dir` (made if missing) with `budget` bytes in
    /// segments of `segment_bytes` (at least two segments' worth), values
    /// sealed with `seal`; serves the segments already there. Fails if
    /// another process holds the directory. Reads and writes go through
    /// io_uring, [`QUEUE_DEPTH`] in flight (or threads where the kernel
    /// refuses io_uring).
    pub fn open(dir: &Path, budget: u64, segment_bytes: u64, seal: Seal) -> io::Result<DiskStore> {
        Self::open_with(
            dir,
            budget,
            segment_bytes,
            seal,
            disk_io::open(QUEUE_DEPTH)?,
        )
    }

    /// [`Self::open`] with reads and writes through `io`, up to its depth
    /// in flight.
    pub fn open_with(
        dir: &Path,
        budget: u64,
        segment_bytes: u64,
        seal: Seal,
        io: Box<dyn DiskIo>,
    ) -> io::Result<DiskStore> {
        let segment_bytes = super::aligned::round_up(segment_bytes.max(1 << 20));
        let max_segments = (budget / segment_bytes) as usize;
        if max_segments < 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a disk budget of {budget} bytes holds fewer than two {segment_bytes}-byte segments"),
            ));
        }
        std::fs::create_dir_all(dir)?;
        let lock = kvring::liveness::open_lock_file(&dir.join(LOCK_FILE))?;
        if !kvring::liveness::try_lock(lock.as_fd())? {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use by another kvring server", dir.display()),
            ));
        }
        let mut ids: Vec<u64> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok()?.file_name().to_str().and_then(segment::id_of))
            .collect();
        ids.sort_unstable();
        let slots = (0..=io.depth())
            .map(|_| Slot {
                head: AlignedBuf::zeroed(BLOCK),
                body: AlignedBuf::zeroed(BLOCK),
            })
            .collect();
        let mut store = DiskStore {
            io,
            slots,
            dir: dir.to_path_buf(),
            seal,
            segment_bytes,
            max_segments,
            segments: VecDeque::new(),
            index: HashMap::new(),
            next_id: ids.last().map_or(0, |l| l + 1),
            own_from: ids.last().map_or(0, |l| l + 1),
            stats: DiskStats::default(),
            _lock: lock,
        };
        for id in ids {
            let index = &mut store.index;
            let (seg, indexed) = Segment::open_existing(dir, id, |digest, rec| {
                // A later record of the same key supersedes an earlier one.
                index.insert(digest, Loc { seg: id, rec });
            })?;
            store.stats.indexed_segments += u64::from(indexed);
            store.segments.push_back(seg);
        }
        while store.segments.len() >= store.max_segments {
            store.drop_oldest();
        }
        Ok(store)
    }

    /// Whether the store has `key`'s object (as far as its index knows).
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(&value::key_digest(key))
    }

    /// The name of the I/O the store uses (`io_uring`, `threads`).
    pub fn io_name(&self) -> &'static str {
        self.io.name()
    }

    /// Writes `object` under `key`, unless the store has it already
    /// (`Ok(false)`). Drops the oldest segment when a new one would exceed
    /// the budget.
    pub fn put(&mut self, key: &str, object: &[u8]) -> io::Result<bool> {
        self.put_many(&[(key, object)]).pop().expect("one result")
    }

    /// Reads `key`'s object of `len` bytes into `dst` (as long), checked
    /// against the key and its seal. `Ok(false)`: a miss (not there, or a
    /// record that is not this key's object, which leaves the index).
    pub fn get(&mut self, key: &str, len: u64, dst: &mut [u8]) -> io::Result<bool> {
        let mut one = [Get { key, len, dst }];
        self.get_many(&mut one).pop().expect("one result")
    }

    /// [`Self::put`] of each `(key, object)`, up to the I/O's depth written
    /// at once: each one's result, in order.
    pub fn put_many(&mut self, items: &[(&str, &[u8])]) -> Vec<io::Result<bool>> {
        let mut out: Vec<Option<io::Result<bool>>> = items.iter().map(|_| None).collect();
        let mut flying: Vec<Option<PutInFlight>> = self.slots.iter().map(|_| None).collect();
        let mut free: Vec<usize> = (0..self.slots.len()).rev().collect();
        let (mut next, mut ready) = (0, None);
        loop {
            if ready.is_none() {
                ready = self.prepare_put(items, &mut next, &mut free, &mut out);
            }
            if ready.is_some() && self.io.in_flight() < self.io.depth() {
                let r = ready.take().expect("checked");
                self.submit_put(r, items, &mut flying, &mut free, &mut out);
                continue;
            }
            if self.io.in_flight() == 0 {
                break;
            }
            let done = match self.io.wait() {
                Ok(d) => d,
                Err(e) => {
                    self.abandon(
                        &e,
                        flying.iter().map(|f| f.as_ref().map(|f| f.item)),
                        &mut out,
                    );
                    break;
                }
            };
            // The disk has room for one more: the next write goes before
            // this one's end is handled.
            if let Some(r) = ready.take() {
                self.submit_put(r, items, &mut flying, &mut free, &mut out);
            }
            let f = flying[done.token as usize].take().expect("a put in flight");
            free.push(done.token as usize);
            let item = f.item;
            out[item] = Some(self.finish_put(f, done));
        }
        finish(out)
    }

    /// Seals the next object that needs a write into a free slot; items
    /// before it that need none get their result here.
    fn prepare_put(
        &mut self,
        items: &[(&str, &[u8])],
        next: &mut usize,
        free: &mut Vec<usize>,
        out: &mut [Option<io::Result<bool>>],
    ) -> Option<ReadyPut> {
        while *next < items.len() {
            let item = *next;
            *next += 1;
            let (key, object) = items[item];
            let digest = value::key_digest(key);
            if self.index.contains_key(&digest) {
                out[item] = Some(Ok(false));
                continue;
            }
            if !segment::fits_empty(self.segment_bytes, object.len() as u64) {
                out[item] = Some(Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "an object of {} bytes is larger than a segment",
                        object.len()
                    ),
                )));
                continue;
            }
            let slot = free.pop().expect("a free slot (one more than in flight)");
            let s = &mut self.slots[slot];
            let v = Value::seal(key, object, &self.seal);
            s.head[..HEADER].copy_from_slice(v.header());
            s.head[HEADER..].fill(0);
            let body = Body::of(object.as_ptr(), object.len());
            let copy_from = match body {
                Body::Direct { whole } => whole,
                Body::Copied => 0,
            };
            let rest = &object[copy_from..];
            let padded = round_up(rest.len() as u64) as usize;
            if s.body.len() < padded {
                s.body = AlignedBuf::zeroed(padded);
            }
            s.body[..rest.len()].copy_from_slice(rest);
            // Zeros after the object, so no stale bytes follow it on disk.
            s.body[rest.len()..padded].fill(0);
            return Some(ReadyPut {
                item,
                digest,
                slot,
                body,
            });
        }
        None
    }

    /// Places `r`'s record (a new segment if the last is full) and starts
    /// its write; the object is in the index from now on, and leaves it
    /// if the write fails.
    fn submit_put(
        &mut self,
        r: ReadyPut,
        items: &[(&str, &[u8])],
        flying: &mut [Option<PutInFlight>],
        free: &mut Vec<usize>,
        out: &mut [Option<io::Result<bool>>],
    ) {
        let object = items[r.item].1;
        let len = object.len() as u64;
        if !self.segments.back().is_some_and(|s| s.has_room(len)) || self.is_read_only_tail() {
            // Writes in flight go to the last segment, which this keeps:
            // only the oldest goes, and there are two at least.
            if let Err(e) = self.add_segment() {
                out[r.item] = Some(Err(e));
                free.push(r.slot);
                return;
            }
        }
        let seg = self.segments.back_mut().expect("a segment to write");
        let rec = seg.reserve(r.digest, len);
        let loc = Loc { seg: seg.id(), rec };
        let op = IoOp::new(r.slot as u64, Way::Write, seg.fd(), rec.off)
            .buf(self.slots[r.slot].head.as_ptr(), BLOCK);
        let op = r
            .body
            .bufs(op, object.as_ptr(), object.len(), &self.slots[r.slot]);
        let bytes = op.bytes();
        // SAFETY: the buffers are the slot's (not touched until this
        // transfer's end frees the slot) and `object`, borrowed for the
        // whole of `put_many`, which returns only once nothing is in
        // flight (or, where the I/O itself failed, never reuses the slot).
        match unsafe { self.io.submit(op) } {
            Ok(()) => {
                self.index.insert(r.digest, loc);
                flying[r.slot] = Some(PutInFlight {
                    item: r.item,
                    digest: r.digest,
                    loc,
                    bytes,
                });
            }
            Err(e) => {
                out[r.item] = Some(Err(e));
                free.push(r.slot);
            }
        }
    }

    /// A write's end: the object stored, or out of the index again.
    fn finish_put(&mut self, f: PutInFlight, done: Done) -> io::Result<bool> {
        let failed = match done.result {
            Ok(n) if n == f.bytes => None,
            Ok(n) => Some(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("{n} of a record's {} bytes written", f.bytes),
            )),
            Err(e) => Some(e),
        };
        match failed {
            None => {
                self.stats.written += 1;
                Ok(true)
            }
            Some(e) => {
                self.forget_at(&f.digest, f.loc);
                Err(e)
            }
        }
    }

    /// [`Self::get`] of each of `items`, up to the I/O's depth read at
    /// once: each one's result, in order.
    pub fn get_many(&mut self, items: &mut [Get<'_>]) -> Vec<io::Result<bool>> {
        let mut out: Vec<Option<io::Result<bool>>> = items.iter().map(|_| None).collect();
        let mut flying: Vec<Option<GetInFlight>> = self.slots.iter().map(|_| None).collect();
        let mut free: Vec<usize> = (0..self.slots.len()).rev().collect();
        let (mut next, mut ready) = (0, None);
        loop {
            if ready.is_none() {
                ready = self.prepare_get(items, &mut next, &mut free, &mut flying, &mut out);
            }
            if ready.is_some() && self.io.in_flight() < self.io.depth() {
                let slot = ready.take().expect("checked");
                self.submit_get(slot, items, &mut flying, &mut free, &mut out);
                continue;
            }
            if self.io.in_flight() == 0 {
                break;
            }
            let done = match self.io.wait() {
                Ok(d) => d,
                Err(e) => {
                    let items = flying.iter().map(|f| f.as_ref().map(|f| f.item));
                    self.abandon(&e, items, &mut out);
                    break;
                }
            };
            // The next read goes before this one's check.
            if let Some(slot) = ready.take() {
                self.submit_get(slot, items, &mut flying, &mut free, &mut out);
            }
            let slot = done.token as usize;
            let f = flying[slot].take().expect("a get in flight");
            let item = f.item;
            out[item] = Some(self.finish_get(slot, f, done, items));
            free.push(slot);
        }
        finish(out)
    }

    /// Finds the next object that needs a read and gives it a slot (its
    /// slot's number); items before it that need none (not in the index)
    /// get their result here.
    fn prepare_get(
        &mut self,
        items: &mut [Get<'_>],
        next: &mut usize,
        free: &mut Vec<usize>,
        flying: &mut [Option<GetInFlight>],
        out: &mut [Option<io::Result<bool>>],
    ) -> Option<usize> {
        while *next < items.len() {
            let item = *next;
            *next += 1;
            let g = &mut items[item];
            assert_eq!(
                g.dst.len() as u64,
                g.len,
                "a destination of the object's size"
            );
            let digest = value::key_digest(g.key);
            let Some(loc) = self.index.get(&digest).copied() else {
                self.stats.missed += 1;
                out[item] = Some(Ok(false));
                continue;
            };
            if !self.segments.iter().any(|s| s.id() == loc.seg) {
                self.index.remove(&digest);
                self.stats.missed += 1;
                out[item] = Some(Ok(false));
                continue;
            }
            if loc.rec.len != g.len {
                // Its header said another size: not this key's object of
                // this size, whatever else it is (not read).
                let e = value::BadValue::Size {
                    expected: g.len,
                    said: loc.rec.len,
                };
                self.corrupt(g.key, &digest, loc, &e);
                out[item] = Some(Ok(false));
                continue;
            }
            let slot = free.pop().expect("a free slot (one more than in flight)");
            let body = Body::of(g.dst.as_ptr(), g.dst.len());
            let padded = round_up(g.len) as usize;
            let s = &mut self.slots[slot];
            if matches!(body, Body::Copied) && s.body.len() < padded {
                s.body = AlignedBuf::zeroed(padded);
            }
            flying[slot] = Some(GetInFlight {
                item,
                digest,
                loc,
                body,
                bytes: 0,
            });
            return Some(slot);
        }
        None
    }

    /// Starts the read prepared in `slot`.
    fn submit_get(
        &mut self,
        slot: usize,
        items: &mut [Get<'_>],
        flying: &mut [Option<GetInFlight>],
        free: &mut Vec<usize>,
        out: &mut [Option<io::Result<bool>>],
    ) {
        let f = flying[slot].as_mut().expect("a prepared get");
        let seg = self
            .segments
            .iter()
            .find(|s| s.id() == f.loc.seg)
            .expect("checked when prepared; no segment goes during a get");
        let dst = &mut items[f.item].dst;
        let op = IoOp::new(slot as u64, Way::Read, seg.fd(), f.loc.rec.off)
            .buf(self.slots[slot].head.as_mut_ptr(), BLOCK);
        let op = f
            .body
            .bufs(op, dst.as_mut_ptr(), dst.len(), &self.slots[slot]);
        f.bytes = op.bytes();
        // SAFETY: the buffers are the slot's (not touched until this
        // transfer's end frees it) and the item's destination, borrowed
        // mutably for the whole of `get_many` and not touched until this
        // transfer ends; `get_many` returns only once nothing is in flight
        // (or, where the I/O itself failed, never reuses the slot).
        if let Err(e) = unsafe { self.io.submit(op) } {
            let f = flying[slot].take().expect("just set");
            out[f.item] = Some(Err(e));
            free.push(slot);
        }
    }

    /// A read's end: the object checked against its key and seal (and
    /// put together where part of it came through the slot).
    fn finish_get(
        &mut self,
        slot: usize,
        f: GetInFlight,
        done: Done,
        items: &mut [Get<'_>],
    ) -> io::Result<bool> {
        match done.result {
            Ok(n) if n == f.bytes => {}
            Ok(n) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{n} of a record's {} bytes read", f.bytes),
                ))
            }
            Err(e) => return Err(e),
        }
        let g = &mut items[f.item];
        let s = &self.slots[slot];
        let len = g.len as usize;
        let head = &s.head[..HEADER];
        let checked = match f.body {
            Body::Direct { whole } => {
                g.dst[whole..].copy_from_slice(&s.body[..len - whole]);
                value::open_parts(head, g.dst, g.key, g.len, &self.seal)
                    .and_then(|o| o.check().map(drop))
            }
            Body::Copied => value::open_parts(head, &s.body[..len], g.key, g.len, &self.seal)
                .and_then(|o| o.copy_into(g.dst)),
        };
        match checked {
            Ok(()) => {
                self.stats.read += 1;
                Ok(true)
            }
            Err(e) => {
                let key = g.key;
                self.corrupt(key, &f.digest, f.loc, &e);
                Ok(false)
            }
        }
    }

    /// A record that is not `key`'s object: a miss, counted, out of the
    /// index.
    fn corrupt(&mut self, key: &str, digest: &[u8; 16], loc: Loc, e: &value::BadValue) {
        tracing::warn!(key, error = %e, "disk tier: a record that is not its key's object (a miss)");
        self.forget_at(digest, loc);
        self.stats.corrupt += 1;
        self.stats.missed += 1;
    }

    /// Takes `digest` out of the index if it still points at `loc`.
    fn forget_at(&mut self, digest: &[u8; 16], loc: Loc) {
        if self
            .index
            .get(digest)
            .is_some_and(|l| l.seg == loc.seg && l.rec == loc.rec)
        {
            self.index.remove(digest);
        }
    }

    /// The I/O failed as a whole (not one transfer): the items in flight
    /// fail with it, and their slots' buffers are let go of without being
    /// freed (the kernel may still use them).
    fn abandon(
        &mut self,
        e: &io::Error,
        in_flight: impl Iterator<Item = Option<usize>>,
        out: &mut [Option<io::Result<bool>>],
    ) {
        tracing::warn!(error = %e, "disk tier: waiting for I/O failed");
        for (slot, item) in in_flight.enumerate() {
            let Some(item) = item else { continue };
            out[item] = Some(Err(io::Error::new(e.kind(), e.to_string())));
            let fresh = Slot {
                head: AlignedBuf::zeroed(BLOCK),
                body: AlignedBuf::zeroed(BLOCK),
            };
            std::mem::forget(std::mem::replace(&mut self.slots[slot], fresh));
        }
    }

    pub fn stats(&self) -> DiskStats {
        DiskStats {
            objects: self.index.len() as u64,
            segments: self.segments.len() as u64,
            segment_bytes: self.segments.len() as u64 * self.segment_bytes,
            ..self.stats
        }
    }

    /// The newest segment came from before this start: nothing is
    /// appended to it (its tail may be torn).
    fn is_read_only_tail(&self) -> bool {
        self.segments.back().is_some_and(|s| s.id() < self.own_from)
    }

    fn add_segment(&mut self) -> io::Result<()> {
        self.finish_tail();
        while self.segments.len() + 1 > self.max_segments {
            self.drop_oldest();
        }
        let seg = Segment::create(&self.dir, self.next_id, self.segment_bytes)?;
        self.next_id += 1;
        self.segments.push_back(seg);
        Ok(())
    }

    /// Writes the last segment's index: it takes no more records (a new
    /// segment follows, or the store closes). Writes still in flight to it
    /// go to the records before the index, which lists them. Without the
    /// index (it failed) a restart scans the segment's headers instead.
    fn finish_tail(&mut self) {
        let Some(tail) = self.segments.back_mut() else {
            return;
        };
        if let Err(e) = tail.finish() {
            tracing::warn!(path = %tail.path().display(), error = %e, "disk tier: writing a segment's index (a restart scans it)");
        }
    }

    /// Drops the oldest segment and every object in it.
    fn drop_oldest(&mut self) {
        let Some(seg) = self.segments.pop_front() else {
            return;
        };
        let id = seg.id();
        let before = self.index.len();
        self.index.retain(|_, l| l.seg != id);
        self.stats.evicted += (before - self.index.len()) as u64;
        if let Err(e) = std::fs::remove_file(seg.path()) {
            tracing::warn!(path = %seg.path().display(), error = %e, "disk tier: removing a segment");
        }
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Nothing is in flight between batches: the index is the last
        // write.
        self.finish_tail();
    }
}

/// Every item's result (each one is set by the time a batch ends).
fn finish(out: Vec<Option<io::Result<bool>>>) -> Vec<io::Result<bool>> {
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(io::Error::other("an item the batch did not reach"))))
        .collect()
}
