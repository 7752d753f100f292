//! The disk store against real files (a directory under the system's
//! temporary directory, removed at the end of each test).

use super::io;
use super::*;
use super::{seg_index, segment};
use crate::l2::value::{MacKey, Seal};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const SEG: u64 = 1 << 20;

/// A unique directory, removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "kvring-disk-test-{tag}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn object(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| {
            (j as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(i * 7919) as u8
        })
        .collect()
}

fn key(i: u32) -> String {
    format!("test:v2:{i:08x}")
}

fn segments(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("seg-"))
        .collect();
    v.sort();
    v
}

fn get(s: &mut DiskStore, i: u32, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    s.get(&key(i), len as u64, &mut buf).unwrap().then_some(buf)
}

#[test]
fn objects_come_back_byte_for_byte_and_only_under_their_key() {
    let d = Dir::new("roundtrip");
    let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
    let len = 100_000;
    for i in 0..20 {
        assert!(s.put(&key(i), &object(i, len)).unwrap());
    }
    assert!(!s.put(&key(3), &object(3, len)).unwrap(), "stored once");
    for i in 0..20 {
        assert_eq!(get(&mut s, i, len).as_deref(), Some(&object(i, len)[..]));
    }
    assert_eq!(get(&mut s, 99, len), None, "never stored");
    let st = s.stats();
    assert_eq!(
        (st.objects, st.written, st.read, st.missed, st.corrupt),
        (20, 20, 20, 1, 0)
    );
    // 20 records of a header block and 100 KB in 25 blocks, in 1 MiB
    // segments.
    assert_eq!(record_bytes(len as u64), 26 * BLOCK as u64);
    assert_eq!(
        segments(&d.0).len(),
        20_usize.div_ceil((1 << 20) / (26 * BLOCK))
    );
}

#[test]
fn a_restarted_store_serves_what_it_held_and_writes_new_segments() {
    let d = Dir::new("restart");
    let len = 200_000;
    {
        let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
        for i in 0..12 {
            s.put(&key(i), &object(i, len)).unwrap();
        }
    }
    let before = segments(&d.0);
    let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
    assert_eq!(s.stats().objects, 12);
    for i in 0..12 {
        assert_eq!(
            get(&mut s, i, len).as_deref(),
            Some(&object(i, len)[..]),
            "object {i}"
        );
    }
    s.put(&key(100), &object(100, len)).unwrap();
    let after = segments(&d.0);
    assert_eq!(
        after.len(),
        before.len() + 1,
        "a new segment, not the old tail"
    );
    assert!(after.last() > before.last());
    assert_eq!(
        get(&mut s, 100, len).as_deref(),
        Some(&object(100, len)[..])
    );
}

#[test]
fn the_budget_drops_the_oldest_segment_whole() {
    let d = Dir::new("budget");
    let len = 300_000; // 3 records a segment
    let mut s = DiskStore::open(&d.0, 3 * SEG, SEG, Seal::Checksum).unwrap();
    for i in 0..30 {
        s.put(&key(i), &object(i, len)).unwrap();
    }
    let st = s.stats();
    assert!(segments(&d.0).len() <= 3, "{:?}", segments(&d.0));
    assert_eq!(st.objects + st.evicted, 30);
    assert!(st.evicted >= 21, "{st:?}");
    assert_eq!(get(&mut s, 0, len), None, "the oldest went");
    assert_eq!(get(&mut s, 29, len).as_deref(), Some(&object(29, len)[..]));
}

/// Writes `bytes` at `off` of the store's only segment file.
fn scribble(dir: &Path, off: u64, bytes: &[u8]) {
    let name = segments(dir).pop().unwrap();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(name))
        .unwrap();
    f.seek(SeekFrom::Start(off)).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_damaged_or_swapped_record_is_a_miss_never_kv() {
    let d = Dir::new("damage");
    let len = 50_000;
    let rec = record_bytes(len as u64);
    let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
    for i in 0..3 {
        s.put(&key(i), &object(i, len)).unwrap();
    }
    // One byte of object 0 flipped on disk (its object starts a block in).
    scribble(&d.0, BLOCK as u64 + 1000, &[!object(0, len)[1000]]);
    assert_eq!(get(&mut s, 0, len), None);
    // Object 1's record replaced by object 2's (a record of another key).
    let name = segments(&d.0).pop().unwrap();
    let raw = std::fs::read(d.0.join(&name)).unwrap();
    scribble(&d.0, rec, &raw[2 * rec as usize..3 * rec as usize]);
    assert_eq!(get(&mut s, 1, len), None);
    assert_eq!(get(&mut s, 2, len).as_deref(), Some(&object(2, len)[..]));
    let st = s.stats();
    assert_eq!((st.corrupt, st.objects), (2, 1), "{st:?}");
    // Asked for the wrong size: a miss too.
    assert_eq!(get(&mut s, 2, len - 1), None);
}

/// What a crash before the segments' indexes landed leaves: their last
/// block (the index's trailer) zeros, so a restart scans their headers.
fn drop_indexes(dir: &Path) {
    for name in segments(dir) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(name))
            .unwrap();
        let len = f.metadata().unwrap().len();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; BLOCK], len - BLOCK as u64).unwrap();
        f.sync_all().unwrap();
    }
}

#[test]
fn a_record_torn_by_a_crash_reads_as_a_miss_after_restart() {
    let d = Dir::new("torn");
    let len = 50_000;
    let rec = record_bytes(len as u64);
    {
        let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
        for i in 0..3 {
            s.put(&key(i), &object(i, len)).unwrap();
        }
    }
    drop_indexes(&d.0);
    // The last record's body never landed (zeros past its first block).
    scribble(
        &d.0,
        2 * rec + BLOCK as u64,
        &vec![0u8; (rec - BLOCK as u64) as usize],
    );
    let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
    assert_eq!(s.stats().objects, 3, "its header landed");
    assert_eq!(get(&mut s, 2, len), None);
    assert_eq!(get(&mut s, 1, len).as_deref(), Some(&object(1, len)[..]));
    // A record whose write never landed (a failed write, a crash) is a
    // gap: the records after it are still found.
    scribble(&d.0, rec, &vec![0u8; rec as usize]);
    drop(s);
    let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
    assert_eq!(s.stats().objects, 2);
    assert_eq!(get(&mut s, 0, len).as_deref(), Some(&object(0, len)[..]));
    assert_eq!(get(&mut s, 1, len), None);
    assert_eq!(get(&mut s, 2, len), None, "still torn");
}

#[test]
fn values_sealed_by_another_secret_or_foreign_files_are_not_taken() {
    let d = Dir::new("foreign");
    let len = 20_000;
    let mac = |b: u8| Seal::Mac(MacKey::from_secret(&[b; 32]).unwrap());
    {
        let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, mac(1)).unwrap();
        s.put(&key(0), &object(0, len)).unwrap();
    }
    // Garbage under a segment's name, and a file that is not a segment.
    std::fs::write(d.0.join("seg-00000000000000ff.kvd"), vec![0x5a; 3 * BLOCK]).unwrap();
    std::fs::write(d.0.join("notes.txt"), b"hello").unwrap();
    let mut other = DiskStore::open(&d.0, 4 * SEG, SEG, mac(2)).unwrap();
    assert_eq!(other.stats().objects, 1);
    assert_eq!(get(&mut other, 0, len), None, "another secret's value");
    drop(other);
    // The record is still on disk (the miss only left the index).
    let mut again = DiskStore::open(&d.0, 4 * SEG, SEG, mac(1)).unwrap();
    assert_eq!(
        get(&mut again, 0, len).as_deref(),
        Some(&object(0, len)[..])
    );
}

#[test]
fn one_server_owns_a_directory() {
    let d = Dir::new("lock");
    let _s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
    let e = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum)
        .err()
        .unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    let e = DiskStore::open(&Dir::new("small").0, SEG, SEG, Seal::Checksum)
        .err()
        .unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
}

#[test]
fn a_header_whose_length_runs_past_its_file_is_not_a_record() {
    let d = Dir::new("length");
    let len = 20_000;
    {
        let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
        s.put(&key(0), &object(0, len)).unwrap();
        s.put(&key(1), &object(1, len)).unwrap();
    }
    drop_indexes(&d.0);
    // The second record's header says it is u64::MAX bytes long: the scan
    // goes on past it, block by block, and finds no other record.
    scribble(&d.0, record_bytes(len as u64) + 16, &u64::MAX.to_le_bytes());
    let mut s = DiskStore::open(&d.0, 4 * SEG, SEG, Seal::Checksum).unwrap();
    assert_eq!(s.stats().objects, 1);
    assert_eq!(get(&mut s, 0, len).as_deref(), Some(&object(0, len)[..]));
    assert_eq!(get(&mut s, 1, len), None);
}

/// `len` bytes of `object(i, ..)` at a block-aligned address (`at` 0) or
/// `at` bytes past one.
fn placed(i: u32, len: usize, at: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len + at);
    b[at..at + len].copy_from_slice(&object(i, len));
    b
}

/// Batches through each way of doing the I/O, with objects that are
/// block-aligned in memory or not, whole blocks long or not: what comes
/// back is each object, in its place, and a damaged one among them is a
/// miss that leaves the others alone.
#[test]
fn batches_round_trip_through_both_kinds_of_io() {
    let ios: Vec<Box<dyn io::DiskIo>> = vec![
        io::open(3).unwrap(),
        Box::new(io::ThreadIo::new(3).unwrap()),
    ];
    for io in ios {
        let name = io.name();
        let d = Dir::new(&format!("batch-{name}"));
        let mut s = DiskStore::open_with(&d.0, 8 * SEG, SEG, Seal::Checksum, io).unwrap();
        // Aligned whole blocks, aligned with a partial last block, not
        // aligned, smaller than a block.
        let shapes = [
            (0, 3 * BLOCK),
            (0, 2 * BLOCK + 100),
            (8, 3 * BLOCK),
            (0, 700),
        ];
        let bufs: Vec<(AlignedBuf, usize, usize)> = (0..12u32)
            .map(|i| {
                let (at, len) = shapes[i as usize % shapes.len()];
                (placed(i, len, at), at, len)
            })
            .collect();
        let keys: Vec<String> = (0..12).map(key).collect();
        let mut items: Vec<(&str, &[u8])> = keys
            .iter()
            .zip(&bufs)
            .map(|(k, (b, at, len))| (k.as_str(), &b[*at..at + len]))
            .collect();
        // The same key twice in one batch: stored once.
        items.push(items[0]);
        let put = s.put_many(&items);
        assert_eq!(put.len(), 13);
        assert!(
            put[..12].iter().all(|r| matches!(r, Ok(true))),
            "{name}: {put:?}"
        );
        assert!(matches!(put[12], Ok(false)), "{name}");
        // Object 5 flipped on disk.
        let off: u64 = bufs[..5].iter().map(|b| record_bytes(b.2 as u64)).sum();
        assert_eq!(segments(&d.0).len(), 1, "{name}");
        scribble(&d.0, off + BLOCK as u64 + 10, &[!object(5, bufs[5].2)[10]]);
        // Read back into destinations of every shape (a key never stored
        // among them).
        let mut dsts: Vec<(AlignedBuf, usize, usize)> = (0..12)
            .map(|i| {
                let at = shapes[(i + 1) % shapes.len()].0;
                let len = bufs[i].2;
                (AlignedBuf::zeroed(len + at), at, len)
            })
            .collect();
        let mut gets: Vec<Get<'_>> = dsts
            .iter_mut()
            .zip(&keys)
            .map(|((b, at, len), k)| Get {
                key: k,
                len: *len as u64,
                dst: &mut b[*at..*at + *len],
            })
            .collect();
        let missing = key(99);
        let mut nothing = [0u8; 10];
        gets.insert(
            3,
            Get {
                key: &missing,
                len: 10,
                dst: &mut nothing,
            },
        );
        let got = s.get_many(&mut gets);
        drop(gets);
        let hits: Vec<bool> = got.into_iter().map(|r| r.unwrap()).collect();
        let mut want = vec![true; 13];
        want[3] = false; // never stored
        want[6] = false; // object 5, flipped
        assert_eq!(hits, want, "{name}");
        for (i, (b, at, len)) in dsts.iter().enumerate() {
            if i != 5 {
                assert_eq!(
                    &b[*at..at + len],
                    &object(i as u32, *len)[..],
                    "{name}: object {i}"
                );
            }
        }
        let st = s.stats();
        assert_eq!(
            (st.written, st.read, st.corrupt, st.objects),
            (12, 11, 1, 11),
            "{name}"
        );
    }
}

#[test]
fn a_restart_reads_each_segments_index_and_scans_where_it_is_not_taken() {
    let d = Dir::new("index");
    let len = 250_000; // 4 records a segment (63 blocks each, and the index)
    let n = 10;
    {
        let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
        for i in 0..n {
            s.put(&key(i), &object(i, len)).unwrap();
        }
        // Full segments have their index while the store runs.
        let names = segments(&d.0);
        assert_eq!(names.len(), 3);
        for name in &names[..2] {
            let f = std::fs::File::open(d.0.join(name)).unwrap();
            let listed = seg_index::read(&f, SEG).expect("an index");
            assert_eq!(listed.len(), 4, "{name}");
        }
    }
    let first = segments(&d.0)[0].clone();
    // The first record's header block lost: the index still lists the
    // segment's other three (and a scan finds them past the gap).
    let zero_first_header = || {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.0.join(&first))
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; BLOCK], 0).unwrap();
    };
    zero_first_header();
    {
        let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
        let st = s.stats();
        assert_eq!((st.indexed_segments, st.objects), (3, n as u64), "{st:?}");
        assert_eq!(
            get(&mut s, 0, len),
            None,
            "listed, but not its key's object"
        );
        for i in 1..n {
            assert_eq!(
                get(&mut s, i, len).as_deref(),
                Some(&object(i, len)[..]),
                "object {i}"
            );
        }
    }
    // One byte of the first segment's entries flipped: that index is not
    // taken, and its headers are scanned (past the lost one).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.0.join(&first))
        .unwrap();
    let at = SEG - seg_index::room(4) + 20;
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[!b[0]], at).unwrap();
    drop(f);
    let mut s = DiskStore::open(&d.0, 8 * SEG, SEG, Seal::Checksum).unwrap();
    let st = s.stats();
    assert_eq!(
        (st.indexed_segments, st.objects),
        (2, n as u64 - 1),
        "{st:?}"
    );
    assert_eq!(get(&mut s, 0, len), None);
    assert_eq!(get(&mut s, 1, len).as_deref(), Some(&object(1, len)[..]));
    assert_eq!(get(&mut s, 9, len).as_deref(), Some(&object(9, len)[..]));
}

#[test]
fn an_index_whose_records_do_not_fit_its_file_is_not_taken() {
    let d = Dir::new("index-check");
    std::fs::create_dir_all(&d.0).unwrap();
    let path = d.0.join("seg");
    let size = 64 * BLOCK as u64;
    let rec = |off: u64, len: u64| ([7u8; 16], segment::Record { off, len });
    let check = |entries: &[seg_index::Entry]| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(size).unwrap();
        let b = seg_index::encode(entries);
        std::os::unix::fs::FileExt::write_all_at(&f, &b, size - b.len() as u64).unwrap();
        seg_index::read(&f, size)
    };
    let b = BLOCK as u64;
    let good = [rec(0, 100), rec(2 * b, 5 * b)];
    assert_eq!(check(&good).as_deref(), Some(&good[..]));
    assert_eq!(check(&[]).as_deref(), Some(&[][..]));
    for bad in [
        vec![rec(1, 100)],                  // not on a block
        vec![rec(0, 2 * b), rec(2 * b, 1)], // overlaps the record before
        vec![rec(0, 100), rec(0, 100)],     // the same place twice
        vec![rec(60 * b, 4 * b)],           // runs into the index
        vec![rec(0, u64::MAX)],             // a length past the file
        vec![rec(u64::MAX / b * b, 1)],     // an offset past the file
    ] {
        assert_eq!(check(&bad), None, "{bad:?}");
    }
    // A count larger than the file can hold is refused before anything is
    // sized by it.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mut t = AlignedBuf::zeroed(BLOCK);
    t.copy_from_slice(&seg_index::encode(&[])[..]);
    t[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    std::os::unix::fs::FileExt::write_all_at(&f, &t, size - b).unwrap();
    drop(f);
    let f = std::fs::File::open(&path).unwrap();
    assert_eq!(seg_index::read(&f, size), None);
}

/// How long opening a store takes for a million records' worth of
/// metadata, through the segments' indexes and through a scan of their
/// headers: prints both (a measure, not a check of a time). The records
/// are made directly, header blocks and indexes only (the objects'
/// blocks are never read when a store opens, and stay holes): objects of
/// one byte, records of two blocks, 256 MiB segments.
/// `KVRING_DISK_RESTART_RECORDS` sets how many (default 1,000,000).
#[test]
#[ignore = "a measurement: writes about 4 GiB of header blocks"]
fn restart_time_for_a_million_records() {
    use std::os::unix::fs::FileExt;
    let n: usize = std::env::var("KVRING_DISK_RESTART_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let d = Dir::new("restart-time");
    std::fs::create_dir_all(&d.0).unwrap();
    let seg_bytes: u64 = 256 << 20;
    let rec = record_bytes(1);
    let mut per_seg = (seg_bytes / rec) as usize;
    while per_seg as u64 * rec + seg_index::room(per_seg) > seg_bytes {
        per_seg -= 1;
    }
    let t = std::time::Instant::now();
    let (mut made, mut segs) = (0, 0u64);
    let mut block = AlignedBuf::zeroed(BLOCK);
    while made < n {
        let k = per_seg.min(n - made);
        let f = std::fs::File::create(d.0.join(segment::file_name(segs))).unwrap();
        f.set_len(seg_bytes).unwrap();
        let mut entries = Vec::with_capacity(k);
        for j in 0..k {
            let name = key((made + j) as u32);
            let object = [j as u8];
            let v = crate::l2::value::Value::seal(&name, &object, &Seal::Checksum);
            block[..crate::l2::value::HEADER].copy_from_slice(v.header());
            let off = j as u64 * rec;
            f.write_all_at(&block, off).unwrap();
            let digest = crate::l2::value::key_digest(&name);
            entries.push((digest, segment::Record { off, len: 1 }));
        }
        let index = seg_index::encode(&entries);
        f.write_all_at(&index, seg_bytes - index.len() as u64)
            .unwrap();
        f.sync_all().unwrap();
        made += k;
        segs += 1;
    }
    eprintln!(
        "{n} records in {segs} segments made in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let budget = (segs + 2) * seg_bytes;
    let t = std::time::Instant::now();
    let s = DiskStore::open(&d.0, budget, seg_bytes, Seal::Checksum).unwrap();
    let through_indexes = t.elapsed();
    let st = s.stats();
    assert_eq!((st.objects, st.indexed_segments), (n as u64, segs));
    drop(s);
    drop_indexes(&d.0);
    let t = std::time::Instant::now();
    let s = DiskStore::open(&d.0, budget, seg_bytes, Seal::Checksum).unwrap();
    let through_headers = t.elapsed();
    let st = s.stats();
    assert_eq!((st.objects, st.indexed_segments), (n as u64, 0));
    println!(
        "opening a store of {n} records in {segs} segments: {:.3} s through the indexes, {:.3} s scanning the headers",
        through_indexes.as_secs_f64(),
        through_headers.as_secs_f64()
    );
}
