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
//! read (a miss, never KV). When a segment takes no more records its index
//! goes into its last blocks ([`seg_index`]); records are never placed
//! there (room for the index is kept as records are placed).

use super::aligned::{round_up, AlignedBuf, BLOCK};
use super::seg_index::{self, Entry};
use crate::l2::value;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Bytes a restart's scan of a segment without its index reads at once.
const SCAN_WINDOW: usize = 1 << 20;

/// A segment file: records from offset 0 to `end`, and, once no record
/// will be added, its index at the end ([`seg_index`]).
pub struct Segment {
    id: u64,
    path: PathBuf,
    file: File,
    /// Where the next record goes.
    end: u64,
    /// The file's size.
    size: u64,
    /// The records placed in it by this start, for its index; `None` for
    /// a segment that takes no more records (one from before this start,
    /// or one whose index is written).
    placed: Option<Vec<Entry>>,
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

/// Whether a record of an object of `len` bytes fits an empty segment of
/// `size` bytes (with the index that would list it).
pub fn fits_empty(size: u64, len: u64) -> bool {
    record_bytes(len).saturating_add(seg_index::room(1)) <= size
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
            placed: Some(Vec::new()),
        })
    }

    /// Opens segment `id` in `dir` as it was left, and finds its records:
    /// `found` is called with each one's key digest and record, in file
    /// order: those its index lists, where it has one that passes its
    /// checks; else those whose headers a scan finds, up to the first
    /// block that is not a header (the end of what was written, or a
    /// record torn before its header landed). No record is appended to it
    /// after. Whether the index was taken.
    pub fn open_existing(
        dir: &Path,
        id: u64,
        mut found: impl FnMut([u8; 16], Record),
    ) -> io::Result<(Segment, bool)> {
        let path = dir.join(file_name(id));
        let file = open(&path, false)?;
        let size = file.metadata()?.len() / BLOCK as u64 * BLOCK as u64;
        let seg = Segment {
            id,
            path,
            file,
            end: size, // read-only from now on
            size,
            placed: None,
        };
        if let Some(entries) = seg_index::read(&seg.file, size) {
            for (digest, rec) in entries {
                found(digest, rec);
            }
            return Ok((seg, true));
        }
        // The scan reads the file a window at a time and looks for a
        // header at every block a record could start at: past a record it
        // jumps to the next, past anything else (a write that failed or
        // never landed, the tail nothing was written to) it tries the next
        // block, so a gap loses no record after it.
        let mut win = AlignedBuf::zeroed(SCAN_WINDOW);
        let mut win_at = (0u64, 0u64); // the window's file range
        let mut off = 0;
        while off + BLOCK as u64 <= size {
            if off < win_at.0 || off + BLOCK as u64 > win_at.1 {
                let n = (size - off).min(SCAN_WINDOW as u64);
                seg.file.read_exact_at(&mut win[..n as usize], off)?;
                win_at = (off, off + n);
            }
            let at = (off - win_at.0) as usize;
            let header = value::peek(&win[at..at + BLOCK]);
            // The length is the file's word: a record that would end past
            // the file (or overflow) is not one.
            match header.map(|(len, digest)| (len, digest, off + record_bytes(len.min(size)))) {
                Some((len, digest, next)) if next <= size => {
                    found(digest, Record { off, len });
                    off = next;
                }
                _ => off += BLOCK as u64,
            }
        }
        Ok((seg, false))
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
    /// record (with the index that would list it).
    pub fn has_room(&self, len: u64) -> bool {
        let Some(placed) = &self.placed else {
            return false;
        };
        self.end + record_bytes(len) + seg_index::room(placed.len() + 1) <= self.size
    }

    /// The place of the next record, `digest`'s object of `len` bytes
    /// (caller checked [`Self::has_room`]), taken: the record after it goes
    /// past it, whether or not its write succeeds (the index lists it
    /// either way; a record that never landed is a miss when read).
    pub fn reserve(&mut self, digest: [u8; 16], len: u64) -> Record {
        assert!(self.has_room(len), "a record that fits");
        let r = Record { off: self.end, len };
        self.end += record_bytes(len);
        self.placed.as_mut().expect("has room").push((digest, r));
        r
    }

    /// Writes the segment's index and takes no more records. A segment
    /// from before this start, or one already indexed, is left as it is.
    pub fn finish(&mut self) -> io::Result<()> {
        let Some(placed) = self.placed.take() else {
            return Ok(());
        };
        let index = seg_index::encode(&placed);
        self.file
            .write_all_at(&index, self.size - index.len() as u64)
    }
}
