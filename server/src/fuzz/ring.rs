//! The ring: the consumer against a hostile producer, and producer and
//! consumer against a model of the frames in flight.

use super::Input;
use kvring::ring::heap::HeapRing;
use kvring::ring::{frame_bytes, Consumer, FrameFlags, FrameHeader, RingError, HEADER_BYTES};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// The ring consumer against a hostile producer, then (second mode) a
/// producer and consumer against a model.
pub fn ring_frames(data: &[u8]) {
    let mut inp = Input(data);
    let mode = inp.u8();
    let capacity = 4096usize << (inp.u8() % 4);
    // Any frame bound the consumer accepts, up to the whole ring.
    let max_frame = HEADER_BYTES + 8 * (usize::from(inp.u16()) % ((capacity - HEADER_BYTES) / 8));
    let ring = HeapRing::new(capacity, max_frame);
    if mode % 2 == 0 {
        hostile_producer(&ring, &mut inp);
    } else {
        modelled_ring(&ring, &mut inp);
    }
}

/// Plays the producer from the same thread as the consumer: the orderings
/// of its stores only mirror a real producer's (Release on the tail it
/// publishes, which the consumer's Acquire load of the tail pairs with).
fn hostile_producer(ring: &HeapRing, inp: &mut Input) {
    let capacity = ring.data.len() as u64 * 8;
    let start = match inp.u8() % 3 {
        0 => inp.u64(),
        1 => u64::MAX - u64::from(inp.u16()),
        _ => u64::from(inp.u16()) * 8,
    };
    ring.head.store(start, Ordering::Relaxed);
    ring.tail
        .store(start.wrapping_add(u64::from(inp.u16())), Ordering::Relaxed);
    for w in &ring.data {
        if inp.is_empty() {
            break;
        }
        w.store(inp.u64(), Ordering::Relaxed);
    }
    // SAFETY: the ring's memory lives in `ring` for the whole function and
    // this is its only consumer.
    let Ok(mut c) = (unsafe { Consumer::new(ring.ptrs()) }) else {
        return;
    };
    let mut buf = vec![0u64; ring.max_frame / 8];
    for _ in 0..10_000 {
        if inp.is_empty() {
            break;
        }
        let before = c.head();
        let r = match inp.u8() % 6 {
            0 | 1 => c.pop(&mut buf),
            2 => c.skip(),
            3 => {
                c.release();
                Ok(None)
            }
            4 => {
                let t = match inp.u8() % 3 {
                    0 => inp.u64(),
                    1 => ring
                        .tail
                        .load(Ordering::Relaxed)
                        .wrapping_add(u64::from(inp.u16())),
                    _ => ring
                        .tail
                        .load(Ordering::Relaxed)
                        .wrapping_add(8 * u64::from(inp.u8())),
                };
                // Release as a producer publishes; pairs with the consumer's
                // Acquire load of the tail.
                ring.tail.store(t, Ordering::Release);
                Ok(None)
            }
            _ => {
                let i = inp.u32() as usize % ring.data.len();
                ring.data[i].store(inp.u64(), Ordering::Relaxed);
                Ok(None)
            }
        };
        match r {
            Ok(Some(h)) => {
                // A frame within the bound, wholly inside the published bytes.
                assert!(h.len as usize <= c.max_payload(), "frame over the bound");
                let moved = c.head().wrapping_sub(before);
                assert_eq!(moved, frame_bytes(h.len as usize) as u64);
                assert!(moved <= capacity);
            }
            Ok(None) => {}
            Err(RingError::Corrupt(_)) => {}
            Err(e) => panic!("a consumer reports only corruption, got {e}"),
        }
    }
}

fn modelled_ring(ring: &HeapRing, inp: &mut Input) {
    let capacity = ring.data.len() * 8;
    // SAFETY: the ring's memory lives in `ring` for the whole function; one
    // producer and one consumer, both used only here.
    let (mut p, mut c) = unsafe { ring.pair() };
    let mut buf = vec![0u64; ring.max_frame / 8];
    // Frames written (and whether published), in order.
    let mut written: VecDeque<(FrameHeader, Vec<u8>)> = VecDeque::new();
    let mut published = 0usize;
    // Bytes written and not yet released by the consumer.
    let mut unreleased = 0usize;
    let mut consumed = 0usize;
    let mut serial = 0u64;
    for _ in 0..10_000 {
        if inp.is_empty() {
            break;
        }
        match inp.u8() % 4 {
            0 | 1 => {
                let len = usize::from(inp.u16()) % (ring.max_frame + 16);
                let fill = inp.u8();
                let payload: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
                serial += 1;
                let h = FrameHeader {
                    opcode: inp.u16(),
                    flags: if inp.u8() % 2 == 0 {
                        0
                    } else {
                        FrameFlags::MORE.bits()
                    },
                    session: 7,
                    user_data: serial,
                    ..Default::default()
                };
                let need = frame_bytes(len);
                match p.write(&h, &payload) {
                    Ok(()) => {
                        unreleased += need;
                        written.push_back((h, payload));
                    }
                    Err(RingError::TooLarge { .. }) => assert!(need > ring.max_frame),
                    Err(RingError::Full { .. }) => {
                        assert!(need <= ring.max_frame);
                        assert!(unreleased + need > capacity, "refused a frame that fits");
                    }
                    Err(e) => panic!("producer: {e}"),
                }
            }
            2 => {
                p.publish();
                published = written.len();
            }
            _ => match c.pop(&mut buf).expect("an honest ring is never corrupt") {
                Some(h) => {
                    assert!(published > 0, "a frame came out before it was published");
                    let (wh, wp) = written.pop_front().expect("a frame was written");
                    published -= 1;
                    assert_eq!(
                        (h.opcode, h.flags, h.user_data),
                        (wh.opcode, wh.flags, wh.user_data)
                    );
                    assert_eq!(
                        &bytemuck::cast_slice::<u64, u8>(&buf)[..h.len as usize],
                        &wp[..]
                    );
                    consumed += frame_bytes(wp.len());
                    if inp.u8() % 2 == 0 {
                        c.release();
                        unreleased -= consumed;
                        consumed = 0;
                    }
                }
                None => assert_eq!(published, 0, "a published frame did not come out"),
            },
        }
    }
}
