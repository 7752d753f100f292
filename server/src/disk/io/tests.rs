//! One conformance suite, run over both ways of doing the I/O: what the
//! store relies on from [`DiskIo`].

use super::*;
use crate::disk::aligned::{AlignedBuf, BLOCK};
use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

fn both(depth: usize) -> Vec<Box<dyn DiskIo>> {
    let uring: Box<dyn DiskIo> = match UringIo::new(depth) {
        Ok(u) => Box::new(u),
        // A kernel that refuses io_uring: the fallback is what runs here,
        // and the suite still runs over it.
        Err(e) => {
            eprintln!("no io_uring on this kernel ({e}); testing the threads only");
            Box::new(ThreadIo::new(depth).unwrap())
        }
    };
    vec![uring, Box::new(ThreadIo::new(depth).unwrap())]
}

/// A file of `blocks` zeroed blocks opened for direct I/O, removed on drop.
struct Scratch {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl Scratch {
    fn new(tag: &str, blocks: usize) -> Scratch {
        let path = std::env::temp_dir().join(format!(
            "kvring-disk-io-{tag}-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).create_new(true);
        let file = o
            .clone()
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .or_else(|_| {
                let _ = std::fs::remove_file(&path);
                o.open(&path)
            })
            .unwrap();
        file.set_len((blocks * BLOCK) as u64).unwrap();
        Scratch { path, file }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn pattern(i: usize, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    for (j, x) in b.iter_mut().enumerate() {
        *x = (j as u32)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(i as u32 * 97) as u8;
    }
    b
}

/// Waits for every transfer in flight; their ends by token.
fn ends(io: &mut dyn DiskIo) -> Vec<Done> {
    let mut v = Vec::new();
    while io.in_flight() > 0 {
        v.push(io.wait().unwrap());
    }
    v
}

#[test]
fn gathered_writes_and_scattered_reads_round_trip_with_several_in_flight() {
    const N: usize = 8;
    const REC: usize = 5 * BLOCK;
    for mut io in both(4) {
        let f = Scratch::new(io.name(), N * REC / BLOCK);
        let fd = f.file.as_raw_fd();
        // Each record written from three buffers: one block, three, one.
        let heads: Vec<AlignedBuf> = (0..N).map(|i| pattern(i, BLOCK)).collect();
        let bodies: Vec<AlignedBuf> = (0..N).map(|i| pattern(i + 100, 3 * BLOCK)).collect();
        let tails: Vec<AlignedBuf> = (0..N).map(|i| pattern(i + 200, BLOCK)).collect();
        let mut seen = HashSet::new();
        let mut most = 0;
        for i in 0..N {
            if io.in_flight() == io.depth() {
                let d = io.wait().unwrap();
                assert_eq!(d.result.unwrap(), REC);
                assert!(seen.insert(d.token));
            }
            let op = IoOp::new(i as u64, Way::Write, fd, (i * REC) as u64)
                .buf(heads[i].as_ptr(), BLOCK)
                .buf(bodies[i].as_ptr(), 3 * BLOCK)
                .buf(tails[i].as_ptr(), BLOCK);
            assert_eq!(op.bytes(), REC);
            // SAFETY: the buffers live until every end is reaped below.
            unsafe { io.submit(op) }.unwrap();
            most = most.max(io.in_flight());
        }
        assert_eq!(most, 4, "{}: several in flight", io.name());
        for d in ends(&mut *io) {
            assert_eq!(d.result.unwrap(), REC);
            assert!(seen.insert(d.token));
        }
        assert_eq!(seen.len(), N, "every token once");
        // Read back in the other shape: two blocks and three.
        let mut got: Vec<(AlignedBuf, AlignedBuf)> = (0..N)
            .map(|_| (AlignedBuf::zeroed(2 * BLOCK), AlignedBuf::zeroed(3 * BLOCK)))
            .collect();
        for (i, (a, b)) in got.iter_mut().enumerate() {
            if io.in_flight() == io.depth() {
                assert_eq!(io.wait().unwrap().result.unwrap(), REC);
            }
            let op = IoOp::new(i as u64, Way::Read, fd, (i * REC) as u64)
                .buf(a.as_mut_ptr(), 2 * BLOCK)
                .buf(b.as_mut_ptr(), 3 * BLOCK);
            // SAFETY: as above; nothing touches `got` until all are reaped.
            unsafe { io.submit(op) }.unwrap();
        }
        for d in ends(&mut *io) {
            assert_eq!(d.result.unwrap(), REC);
        }
        for (i, (a, b)) in got.iter().enumerate() {
            let whole = [&heads[i][..], &bodies[i][..], &tails[i][..]].concat();
            assert_eq!(
                [&a[..], &b[..]].concat(),
                whole,
                "{}: record {i}",
                io.name()
            );
        }
    }
}

#[test]
fn a_read_past_the_end_is_short_and_a_bad_descriptor_fails_its_own_transfer() {
    for mut io in both(2) {
        let f = Scratch::new(io.name(), 2);
        let fd = f.file.as_raw_fd();
        let mut a = AlignedBuf::zeroed(4 * BLOCK);
        let mut b = AlignedBuf::zeroed(BLOCK);
        let short = IoOp::new(7, Way::Read, fd, BLOCK as u64).buf(a.as_mut_ptr(), 4 * BLOCK);
        // A descriptor that is not open.
        let bad = IoOp::new(9, Way::Read, -1, 0).buf(b.as_mut_ptr(), BLOCK);
        // SAFETY: `a` and `b` live until both ends are reaped.
        unsafe {
            io.submit(short).unwrap();
            io.submit(bad).unwrap();
        }
        let mut got = ends(&mut *io);
        got.sort_by_key(|d| d.token);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].token, 7);
        assert_eq!(got[0].result.as_ref().unwrap(), &BLOCK, "one block left");
        assert_eq!(got[1].token, 9);
        let e = got[1].result.as_ref().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{}: {e}", io.name());
        assert_eq!(io.in_flight(), 0);
    }
}

#[test]
fn a_handle_dropped_with_transfers_in_flight_waits_for_them() {
    for mut io in both(3) {
        let f = Scratch::new(io.name(), 3);
        let fd = f.file.as_raw_fd();
        let bufs: Vec<AlignedBuf> = (0..3).map(|i| pattern(i, BLOCK)).collect();
        for (i, b) in bufs.iter().enumerate() {
            let op = IoOp::new(i as u64, Way::Write, fd, (i * BLOCK) as u64).buf(b.as_ptr(), BLOCK);
            // SAFETY: `bufs` outlives `io`, whose drop waits for these.
            unsafe { io.submit(op) }.unwrap();
        }
        drop(io);
        let on_disk = std::fs::read(&f.path).unwrap();
        let want = [&bufs[0][..], &bufs[1][..], &bufs[2][..]].concat();
        assert_eq!(on_disk, want);
    }
}
