//! Model checking of the ring protocol: every interleaving (within loom's
//! preemption bound) of a producer and a consumer on a ring small enough to
//! wrap and fill. A wrong ordering on `tail` shows up as a stale payload word;
//! a wrong ordering on `head` as a frame overwritten before it was read.

use super::*;
use crate::sync::AtomicU64;
use loom::sync::Arc;

struct HeapRing {
    head: AtomicU64,
    tail: AtomicU64,
    data: Vec<AtomicU64>,
}

/// 16 words: four 40-byte frames cannot fit at once, so the producer must
/// wait for the consumer's releases and reuse space the consumer has read.
const CAPACITY: usize = 128;

fn ring(start: u64) -> Arc<HeapRing> {
    Arc::new(HeapRing {
        head: AtomicU64::new(start),
        tail: AtomicU64::new(start),
        data: (0..CAPACITY / 8).map(|_| AtomicU64::new(0)).collect(),
    })
}

fn ptrs(r: &HeapRing) -> RingPtrs {
    RingPtrs {
        head: &r.head,
        tail: &r.tail,
        data: r.data.as_ptr(),
        capacity: CAPACITY,
        max_frame: 64,
    }
}

fn run(frames: u64, start: u64) {
    let r = ring(start);
    let r2 = r.clone();
    let producer = loom::thread::spawn(move || {
        // SAFETY: `r2` keeps the ring alive for the producer's life.
        let mut p = unsafe { Producer::new(ptrs(&r2)).unwrap() };
        for i in 1..=frames {
            let h = FrameHeader {
                opcode: 1,
                user_data: i,
                ..Default::default()
            };
            loop {
                match p.write_words(&h, &[i, !i]) {
                    Ok(()) => break,
                    Err(RingError::Full { .. }) => crate::sync::spin_hint(),
                    Err(e) => panic!("{e}"),
                }
            }
            p.publish();
        }
    });
    // SAFETY: `r` outlives the consumer.
    let mut c = unsafe { Consumer::new(ptrs(&r)).unwrap() };
    let mut buf = [0u64; 8];
    let mut next = 1;
    while next <= frames {
        match c.pop(&mut buf).unwrap() {
            Some(h) => {
                assert_eq!(h.user_data, next);
                assert_eq!(h.len, 16);
                assert_eq!(&buf[..2], &[next, !next]);
                next += 1;
                c.release();
            }
            None => crate::sync::spin_hint(),
        }
    }
    producer.join().unwrap();
}

#[test]
fn loom_frames_arrive_whole_in_order_across_the_wrap() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    // Start near the end so the second frame straddles the wrap.
    model.check(|| run(2, 96));
}

#[test]
fn loom_producer_never_overwrites_unread_frames() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    // Four frames of 40 bytes through 128 bytes: the last ones reuse space.
    model.check(|| run(4, 0));
}
