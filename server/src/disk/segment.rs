//! One segment file of the disk store (`seg-ID.kvd`, ID in hex): values
//! appended at block-aligned offsets, each the remote tier's value format
//! (a 64-byte header that binds the object to its key, then the object),
//! padded to whole blocks. The file is allocated whole when it is made, so
//! what was never written reads as zeros, which no header matches; it is
//! written and read with direct I/O, so a read comes from the disk and a
//! write does not fill the page cache with KV nobody reads twice.
//!
//! A record is written with one positioned write; a crash can leave it
//! torn, which its seal catches when it is read (a miss, never KV).

use super::aligned::{round_up, AlignedBuf, BLOCK};
use crate::l2::value::{self, Value, HEADER};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A segment file: records from offset 0 to `end`.
pub struct Segment {
    id: u64,
    path: PathBuf,
    file: File,
    /// Where the next record goes.
    end: u64,
    /// The file's size.
    size: u64,
}

/// A record's place: its offset and its value's bytes (header included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub off: u64,
    pub len: u64,
}

/// The file name of segment `id`.
pub fn file_name(id: u64) -> String {
    format!("seg-{id:016x}.kvd")
}

/// The id of a segment's file name, if it is one.
pub fn id_of(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".kvd")?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

fn open(path: &Path, create: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(create);
    match o.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok(f),
        // A file system without direct I/O (tmpfs): the page cache it is,
        // said once.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    path = %path.display(),
                    "disk tier: no direct I/O on this file system; reads and writes go through the page cache"
                )
            });
            o.open(path)
        }
        Err(e) => Err(e),
    }
}

impl Segment {
    /// Makes segment `id` in `dir`, `size` bytes (whole blocks), allocated
    /// now (a full disk fails here, not in a later write).
    pub fn create(dir: &Path, id: u64, size: u64) -> io::Result<Segment> {
        let size = round_up(size);
        let path = dir.join(file_name(id));
        let file = open(&path, true)?;
        let made = nix::fcntl::posix_fallocate(&file, 0, size as libc::off_t);
        if let Err(e) = made.map_err(io::Error::from) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(Segment {
            id,
            path,
            file,
            end: 0,
            size,
        })
    }

    /// Opens segment `id` in `dir` as it was left, and finds its records:
    /// `found` is called with each header's key digest and record, in file
    /// order, up to the first block that is not a header (the end of what
    /// was written, or a record torn before its header landed). No record
    /// is appended to it after.
    pub fn open_existing(
        dir: &Path,
        id: u64,
        mut found: impl FnMut([u8; 16], Record),
    ) -> io::Result<Segment> {
        let path = dir.join(file_name(id));
        let file = open(&path, false)?;
        let size = file.metadata()?.len() / BLOCK as u64 * BLOCK as u64;
        let mut seg = Segment {
            id,
            path,
            file,
            end: 0,
            size,
        };
        let mut head = AlignedBuf::zeroed(BLOCK);
        let mut off = 0;
        while off + BLOCK as u64 <= size {
            seg.file.read_exact_at(&mut head, off)?;
            let Some((len, digest)) = value::peek(&head) else {
                break;
            };
            // The length is the file's word: a record that would end past
            // the file (or overflow) ends the scan.
            let bytes = HEADER as u64 + len.min(size);
            let next = off + round_up(bytes);
            if next > size {
                break;
            }
            found(digest, Record { off, len: bytes });
            off = next;
        }
        seg.end = size; // read-only from now on
        Ok(seg)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a value of `bytes` fits after the last record.
    pub fn has_room(&self, bytes: u64) -> bool {
        self.end + round_up(bytes) <= self.size
    }

    /// Appends `v` (caller checked [`Self::has_room`]); its record.
    pub fn append(&mut self, v: &Value<'_>, scratch: &mut AlignedBuf) -> io::Result<Record> {
        let bytes = v.len() as u64;
        assert!(self.has_room(bytes), "a record that fits");
        let padded = round_up(bytes) as usize;
        if scratch.len() < padded {
            *scratch = AlignedBuf::zeroed(padded);
        }
        v.write_into(&mut scratch[..v.len()]);
        // The padding: zeros, so no stale bytes of an earlier record follow.
        scratch[v.len()..padded].fill(0);
        self.file.write_all_at(&scratch[..padded], self.end)?;
        let r = Record {
            off: self.end,
            len: bytes,
        };
        self.end += padded as u64;
        Ok(r)
    }

    /// Reads record `r` into `buf` (grown as needed); the value is
    /// `buf[..r.len]`.
    pub fn read(&self, r: Record, buf: &mut AlignedBuf) -> io::Result<()> {
        let padded = round_up(r.len) as usize;
        if buf.len() < padded {
            *buf = AlignedBuf::zeroed(padded);
        }
        self.file.read_exact_at(&mut buf[..padded], r.off)
    }
}
