//! The disk store: chunk objects in segment files under one directory,
//! found through an index in memory, kept within a byte budget by dropping
//! the oldest segment whole (objects go to disk when the pool evicts them,
//! so the oldest segment holds what was evicted longest ago).
//!
//! One server owns a directory at a time: a lock file (`kvring-disk.lock`,
//! an OFD lock the kernel drops when the server dies) refuses a second.
//! A server started on a directory that holds segments serves what they
//! hold: each segment's record headers are read once (one block per
//! record, in file order), and new records go to a new segment. Every read
//! checks the value against the key it was asked under (its key digest,
//! size and seal): a torn, truncated, foreign or swapped record is a miss,
//! counted, and leaves the index.

use super::aligned::AlignedBuf;
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
}

/// A store in a directory of its own.
pub struct DiskStore {
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
    scratch: AlignedBuf,
    stats: DiskStats,
    _lock: File,
}

/// The lock file of a store's directory.
pub const LOCK_FILE: &str = "kvring-disk.lock";

impl DiskStore {
    /// Opens the store in `dir` (made if missing) with `budget` bytes in
    /// segments of `segment_bytes` (at least two segments' worth), values
    /// sealed with `seal`; serves the segments already there. Fails if
    /// another process holds the directory.
    pub fn open(dir: &Path, budget: u64, segment_bytes: u64, seal: Seal) -> io::Result<DiskStore> {
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
        let mut store = DiskStore {
            dir: dir.to_path_buf(),
            seal,
            segment_bytes,
            max_segments,
            segments: VecDeque::new(),
            index: HashMap::new(),
            next_id: ids.last().map_or(0, |l| l + 1),
            own_from: ids.last().map_or(0, |l| l + 1),
            scratch: AlignedBuf::zeroed(0),
            stats: DiskStats::default(),
            _lock: lock,
        };
        for id in ids {
            let index = &mut store.index;
            let seg = Segment::open_existing(dir, id, |digest, rec| {
                // A later record of the same key supersedes an earlier one.
                index.insert(digest, Loc { seg: id, rec });
            })?;
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

    /// Writes `object` under `key`, unless the store has it already
    /// (`Ok(false)`). Drops the oldest segment when a new one would exceed
    /// the budget.
    pub fn put(&mut self, key: &str, object: &[u8]) -> io::Result<bool> {
        let digest = value::key_digest(key);
        if self.index.contains_key(&digest) {
            return Ok(false);
        }
        let v = Value::seal(key, object, &self.seal);
        let bytes = v.len() as u64;
        if super::aligned::round_up(bytes) > self.segment_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "an object of {} bytes is larger than a segment",
                    object.len()
                ),
            ));
        }
        if !self.segments.back().is_some_and(|s| s.has_room(bytes)) || self.is_read_only_tail() {
            self.add_segment()?;
        }
        let seg = self.segments.back_mut().expect("a segment to write");
        let rec = seg.append(&v, &mut self.scratch)?;
        self.index.insert(digest, Loc { seg: seg.id(), rec });
        self.stats.written += 1;
        Ok(true)
    }

    /// Reads `key`'s object of `len` bytes into `dst` (as long), checked
    /// against the key and its seal. `Ok(false)`: a miss (not there, or a
    /// record that is not this key's object, which leaves the index).
    pub fn get(&mut self, key: &str, len: u64, dst: &mut [u8]) -> io::Result<bool> {
        let digest = value::key_digest(key);
        let Some(loc) = self.index.get(&digest).copied() else {
            self.stats.missed += 1;
            return Ok(false);
        };
        let Some(seg) = self.segments.iter().find(|s| s.id() == loc.seg) else {
            self.index.remove(&digest);
            self.stats.missed += 1;
            return Ok(false);
        };
        seg.read(loc.rec, &mut self.scratch)?;
        let checked = value::open(&self.scratch[..loc.rec.len as usize], key, len, &self.seal)
            .and_then(|o| o.copy_into(dst));
        match checked {
            Ok(()) => {
                self.stats.read += 1;
                Ok(true)
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "disk tier: a record that is not its key's object (a miss)");
                self.index.remove(&digest);
                self.stats.corrupt += 1;
                self.stats.missed += 1;
                Ok(false)
            }
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
        while self.segments.len() + 1 > self.max_segments {
            self.drop_oldest();
        }
        let seg = Segment::create(&self.dir, self.next_id, self.segment_bytes)?;
        self.next_id += 1;
        self.segments.push_back(seg);
        Ok(())
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

/// Bytes a value of an object of `len` bytes takes on disk.
pub fn record_bytes(len: u64) -> u64 {
    super::aligned::round_up(HEADER as u64 + len)
}
