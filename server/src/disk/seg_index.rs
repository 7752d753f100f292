//! A segment's index: written at the end of a segment when no record
//! will be added to it (the next segment is made, or the store closes),
//! so that a server started on the directory reads one index per segment
//! rather than one header block per record.
//!
//! It takes the segment's last blocks: the entries, 32 bytes each, from a
//! block boundary, then one trailer block.
//!
//! | entry offset | bytes | field |
//! |---|---|---|
//! | 0 | 16 | key digest (as in the record's header) |
//! | 16 | 8 | the record's offset, u64 LE |
//! | 24 | 8 | its object's bytes, u64 LE |
//!
//! | trailer offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVRSEGIX` |
//! | 8 | 4 | version, u32 LE (1) |
//! | 12 | 4 | zero |
//! | 16 | 8 | entries, u64 LE |
//! | 24 | 16 | XXH3-128 (LE) of the entries' bytes |
//! | 40 | 16 | XXH3-128 (LE) of trailer bytes 0..40 |
//!
//! The index is the file's word like everything in it: one whose trailer
//! or entries fail their checksum, whose count does not fit the file, or
//! whose records are not in order, block-aligned and before the index is
//! not taken (the segment's headers are scanned instead). An entry only
//! steers a read: the record it names must still open under its key.

use super::aligned::{round_up, AlignedBuf, BLOCK};
use super::segment::{record_bytes, Record};
use std::fs::File;
use std::os::unix::fs::FileExt;
use xxhash_rust::xxh3::xxh3_128;

/// Bytes of one entry.
const ENTRY: usize = 32;
/// `"KVRSEGIX"` as a little-endian u64.
const MAGIC: u64 = u64::from_le_bytes(*b"KVRSEGIX");
const VERSION: u32 = 1;

/// One record as the index lists it: its key's digest and its place.
pub type Entry = ([u8; 16], Record);

/// Bytes the index of `n` records takes at the end of a segment.
pub fn room(n: usize) -> u64 {
    round_up((n * ENTRY) as u64) + BLOCK as u64
}

/// The index of `entries`, to be written at `size - room(entries.len())`
/// of a segment of `size` bytes.
pub fn encode(entries: &[Entry]) -> AlignedBuf {
    let n = entries.len();
    let room = room(n) as usize;
    let mut b = AlignedBuf::zeroed(room);
    for (e, (digest, rec)) in b.chunks_exact_mut(ENTRY).zip(entries) {
        e[0..16].copy_from_slice(digest);
        e[16..24].copy_from_slice(&rec.off.to_le_bytes());
        e[24..32].copy_from_slice(&rec.len.to_le_bytes());
    }
    let body = xxh3_128(&b[..n * ENTRY]).to_le_bytes();
    let t = &mut b[room - BLOCK..];
    t[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    t[8..12].copy_from_slice(&VERSION.to_le_bytes());
    t[16..24].copy_from_slice(&(n as u64).to_le_bytes());
    t[24..40].copy_from_slice(&body);
    let own = xxh3_128(&t[..40]).to_le_bytes();
    t[40..56].copy_from_slice(&own);
    b
}

/// The records the index at the end of `file` (a segment of `size`
/// bytes, whole blocks) lists, in file order; `None` where there is no
/// index or it is not taken (see the module's doc).
pub fn read(file: &File, size: u64) -> Option<Vec<Entry>> {
    if size < BLOCK as u64 {
        return None;
    }
    let mut t = AlignedBuf::zeroed(BLOCK);
    file.read_exact_at(&mut t, size - BLOCK as u64).ok()?;
    let word = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let half = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    if word(&t, 0) != MAGIC || half(&t, 8) != VERSION || half(&t, 12) != 0 {
        return None;
    }
    if xxh3_128(&t[..40]).to_le_bytes()[..] != t[40..56] {
        return None;
    }
    // The count is checked against the file before anything is sized by
    // it.
    let n = word(&t, 16);
    if n > size / ENTRY as u64 {
        return None;
    }
    let n = n as usize;
    if room(n) > size {
        return None;
    }
    let area = size - room(n);
    let mut b = AlignedBuf::zeroed(room(n) as usize - BLOCK);
    if !b.is_empty() {
        file.read_exact_at(&mut b, area).ok()?;
    }
    if xxh3_128(&b[..n * ENTRY]).to_le_bytes()[..] != t[24..40] {
        return None;
    }
    let mut entries = Vec::with_capacity(n);
    let mut end = 0u64;
    for e in b[..n * ENTRY].chunks_exact(ENTRY) {
        let digest: [u8; 16] = e[0..16].try_into().expect("16 bytes");
        let (off, len) = (word(e, 16), word(e, 24));
        // In order, block-aligned, and ending before the index (a length
        // past the file is refused before it is rounded).
        if off % BLOCK as u64 != 0 || off < end || len > size {
            return None;
        }
        let next = off.checked_add(record_bytes(len))?;
        if next > area {
            return None;
        }
        entries.push((digest, Record { off, len }));
        end = next;
    }
    Some(entries)
}
