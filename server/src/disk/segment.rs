//! One segment file of the disk store (`seg-ID.kvd`, ID in hex): records
//! at block-aligned offsets, each the remote tier's value format split in
//! two: one block that holds the value's 64-byte header (which binds the
//! object to its key, size and seal; the rest of the block zeros), then
//! the object from the next block on, padded with zeros to whole blocks.
//! The object starting on a block of its own is what lets it be read and
//! written with direct I/O straight from and into the caller's memory.
//!
//! | record offset | bytes | what |
//! |---|---|---|
//! | 0 | 64 | the value's header (`l2::value`) |
//! | 64 | 4032 | zeros |
//! | 4096 | n | the object |
//! | 4096 + n | to a block's end | zeros |
//!
//! The file is allocated whole when it is made, so what was never written
//! reads as zeros, which no header matches; it is written and read with
//! direct I/O, so a read comes from the disk and a write does not fill the
//! page cache with KV nobody reads twice.
//!
//! A record is written with one positioned write (header block and object
//! gathered); a crash can leave it torn, which its seal catches when it is
//! read (a miss, never KV).

use super::aligned::{round_up, AlignedBuf, BLOCK};
use crate::l2::value;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
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

/// A record's place: the offset of its header block, and its object's
/// bytes (which start one block further).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub off: u64,
    pub len: u64,
}

/// Bytes a record of an object of `len` bytes takes: its header block and
/// the object in whole blocks.
pub fn record_bytes(len: u64) -> u64 {
    BLOCK as u64 + round_up(len)
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
            let next = off + record_bytes(len.min(size));
            if next > size {
                break;
            }
            found(digest, Record { off, len });
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

    /// The file, for transfers to and from it.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Whether a record of an object of `len` bytes fits after the last
    /// record.
    pub fn has_room(&self, len: u64) -> bool {
        self.end + record_bytes(len) <= self.size
    }

    /// The place of the next record, an object of `len` bytes (caller
    /// checked [`Self::has_room`]), taken: the record after it goes past
    /// it, whether or not its write succeeds.
    pub fn reserve(&mut self, len: u64) -> Record {
        assert!(self.has_room(len), "a record that fits");
        let r = Record { off: self.end, len };
        self.end += record_bytes(len);
        r
    }
}
