use super::*;
use crate::sync::Ordering;

use super::heap::HeapRing;

/// Both halves of a heap ring (it outlives them in every test below).
fn pair(r: &HeapRing) -> (Producer, Consumer) {
    // SAFETY: each test keeps `r` alive past both halves and makes one pair.
    unsafe { r.pair() }
}

fn hdr(op: u16, user: u64) -> FrameHeader {
    FrameHeader {
        opcode: op,
        user_data: user,
        session: 7,
        ..Default::default()
    }
}

#[test]
fn frames_round_trip_with_wraparound() {
    let r = HeapRing::new(4096, 1024);
    let (mut p, mut c) = pair(&r);
    let mut buf = vec![0u64; 128];
    for i in 0..5000u64 {
        let len = (i as usize * 37) % 900;
        let payload: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
        p.push(&hdr(3, i), &payload).unwrap();
        let h = c.pop(&mut buf).unwrap().unwrap();
        c.release();
        assert_eq!(h.user_data, i);
        assert_eq!(h.len as usize, len);
        assert_eq!(h.session, 7);
        assert_eq!(&bytemuck::cast_slice::<u64, u8>(&buf)[..len], &payload[..]);
    }
    assert!(c.pop(&mut buf).unwrap().is_none());
}

#[test]
fn full_ring_refuses_then_accepts_after_release() {
    let r = HeapRing::new(4096, 1024);
    let (mut p, mut c) = pair(&r);
    let payload = [0xabu8; 1000];
    let mut n = 0;
    loop {
        match p.push(&hdr(1, n), &payload) {
            Ok(()) => n += 1,
            Err(RingError::Full { need, free }) => {
                assert_eq!(need, frame_bytes(1000));
                assert!(free < need);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(n, 4096 / frame_bytes(1000) as u64);
    let mut buf = vec![0u64; 128];
    assert_eq!(c.pop(&mut buf).unwrap().unwrap().user_data, 0);
    // Not released yet: still full.
    assert!(matches!(
        p.push(&hdr(1, n), &payload),
        Err(RingError::Full { .. })
    ));
    c.release();
    p.push(&hdr(1, n), &payload).unwrap();
}

#[test]
fn oversized_frame_is_refused_with_the_bound() {
    let r = HeapRing::new(4096, 1024);
    let (mut p, _c) = pair(&r);
    let err = p.push(&hdr(1, 0), &[0u8; 1001]).unwrap_err();
    assert_eq!(
        err,
        RingError::TooLarge {
            len: 1001,
            max: 1000
        }
    );
}

#[test]
fn batch_is_invisible_until_published() {
    let r = HeapRing::new(4096, 1024);
    let (mut p, mut c) = pair(&r);
    p.write(&hdr(1, 1), b"a").unwrap();
    p.write(&hdr(1, 2), b"b").unwrap();
    let mut buf = vec![0u64; 128];
    assert!(c.pop(&mut buf).unwrap().is_none());
    assert!(p.publish());
    assert_eq!(c.pop(&mut buf).unwrap().unwrap().user_data, 1);
    assert_eq!(c.pop(&mut buf).unwrap().unwrap().user_data, 2);
}

#[test]
fn corrupt_tail_and_lengths_are_detected() {
    let r = HeapRing::new(4096, 1024);
    let (_p, mut c) = pair(&r);
    // Tail beyond head + capacity.
    r.tail.store(8192, Ordering::Relaxed);
    assert!(matches!(c.available(), Err(RingError::Corrupt(_))));

    let r = HeapRing::new(4096, 1024);
    let (_p, mut c) = pair(&r);
    // Misaligned tail.
    r.tail.store(12, Ordering::Relaxed);
    assert!(matches!(c.available(), Err(RingError::Corrupt(_))));

    let r = HeapRing::new(4096, 1024);
    let (_p, mut c) = pair(&r);
    // A header claiming more payload than the bound.
    r.data[0].store(u64::from(u32::MAX), Ordering::Relaxed);
    r.tail.store(64, Ordering::Relaxed);
    assert!(matches!(c.peek(), Err(RingError::Corrupt(_))));

    let r = HeapRing::new(4096, 1024);
    let (_p, mut c) = pair(&r);
    // A header claiming more payload than was published.
    r.data[0].store(200, Ordering::Relaxed);
    r.tail.store(64, Ordering::Relaxed);
    assert!(matches!(c.peek(), Err(RingError::Corrupt(_))));

    // Producer side: head running ahead of the tail.
    let r2 = HeapRing::new(4096, 1024);
    let (mut p2, _c2) = pair(&r2);
    r2.head.store(64, Ordering::Relaxed);
    assert!(matches!(p2.free(), Err(RingError::Corrupt(_))));
}

#[test]
fn geometry_is_checked() {
    assert!(check_geometry(4096, 1024).is_ok());
    assert!(check_geometry(3000, 512).is_err());
    assert!(check_geometry(4096, 2048).is_err());
    assert!(check_geometry(4096, 1020).is_err());
}

#[test]
fn two_threads_stream_in_order() {
    let r = HeapRing::new(8192, 2048);
    let (mut p, mut c) = pair(&r);
    const N: u64 = 200_000;
    std::thread::scope(|s| {
        s.spawn(move || {
            for i in 0..N {
                let payload = i.to_ne_bytes().repeat((i % 5) as usize + 1);
                loop {
                    match p.push(&hdr(2, i), &payload) {
                        Ok(()) => break,
                        Err(RingError::Full { .. }) => std::hint::spin_loop(),
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        });
        let mut buf = vec![0u64; 256];
        let mut next = 0;
        while next < N {
            if let Some(h) = c.pop(&mut buf).unwrap() {
                assert_eq!(h.user_data, next);
                let words = (next % 5) as usize + 1;
                assert_eq!(h.len as usize, words * 8);
                assert!(buf[..words].iter().all(|&w| w == next));
                next += 1;
                if next % 7 == 0 {
                    c.release();
                }
            } else {
                c.release();
                std::hint::spin_loop();
            }
        }
    });
}
