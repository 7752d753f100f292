//! KV events: the node's event stream for cache-aware routers
//! (`kvring serve --kv-events ADDR`), in vLLM's wire format (msgpack
//! batches of `BlockStored` / `BlockRemoved` / `AllBlocksCleared` on a
//! ZeroMQ PUB socket, with a replay socket), for every engine of the node.
//!
//! The cache pushes a `Record` for each object that becomes readable or
//! leaves the pool, under its lock, so records are in the order the cache
//! changed; the ring loop pushes the token ids engines DESCRIBE ahead of
//! their stores. Pushing never waits: the `EventQueue` is bounded, and a
//! record that finds it full is dropped and counted, and marks the stream
//! lost. The publisher thread (`publisher.rs`) drains the queue, turns
//! records into events (token ids from `tokens.rs`), and sends them;
//! a lost stream is followed by a resync ("all cleared", then every object
//! the pool holds, read under the cache's lock). A subscriber that is slow
//! or absent costs the rings and the copies nothing: the PUB socket drops
//! what a subscriber does not take (its high-water mark), and the replay
//! buffer is bounded in bytes.
//!
//! The schema, the hashes and the replay protocol: `docs/events.md`.

pub(crate) mod publisher;
mod tokens;
mod wire;

use crate::cache::{Levels, ObjectKey};
use kvring::kv::ChainState;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

pub use publisher::Publisher;

/// The event stream's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct EventsConfig {
    /// Where the PUB socket binds (a ZeroMQ endpoint: `tcp://*:5557`,
    /// `ipc:///run/kvring-events`).
    pub endpoint: String,
    /// Where the replay socket (ROUTER) binds, if anywhere.
    pub replay: Option<String>,
    /// The topic of every message.
    pub topic: String,
    /// Records queued for the publisher at most (more are dropped, and a
    /// resync follows).
    pub queue: usize,
    /// Bytes of published batches kept for replay at most.
    pub replay_bytes: u64,
    /// Messages the PUB socket queues for one subscriber at most (ZeroMQ's
    /// send high-water mark; past it the subscriber misses messages).
    pub hwm: i32,
}

impl EventsConfig {
    /// A stream on `endpoint` with the defaults (vLLM's, where vLLM has
    /// one).
    pub fn new(endpoint: &str) -> EventsConfig {
        EventsConfig {
            endpoint: endpoint.to_string(),
            replay: None,
            topic: "kvring".into(),
            queue: 1 << 16,
            replay_bytes: 64 << 20,
            hwm: 100_000,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.queue == 0 {
            return Err("--kv-events-queue must be at least 1".into());
        }
        if self.hwm < 0 {
            return Err("--kv-events-hwm must not be negative".into());
        }
        if self.replay.as_deref() == Some(self.endpoint.as_str()) {
            return Err("--kv-events-replay must differ from --kv-events".into());
        }
        Ok(())
    }
}

/// One fact for the stream, in the order it happened.
#[derive(Debug)]
pub(crate) enum Record {
    /// An engine's DESCRIBE: the token ids of consecutive chunks, whose
    /// hash chain continues from `prev`.
    Describe {
        model_id: u64,
        salt: u64,
        prev: ChainState,
        tokens: Box<[u32]>,
    },
    /// The object became readable in the pool.
    Stored(ObjectKey),
    /// The object left the pool; `to`: the tiers below that have it or
    /// are being given it.
    Removed { key: ObjectKey, to: Levels },
}

/// The bounded queue between the cache (and the ring loop) and the
/// publisher, with the stream's counters.
pub(crate) struct EventQueue {
    records: Mutex<VecDeque<Record>>,
    cap: usize,
    /// A record was dropped since the last resync. Release (set by a
    /// pusher) pairs with the publisher's Acquire load.
    lost: AtomicBool,
    pub(crate) dropped: AtomicU64,
    pub(crate) published: AtomicU64,
    pub(crate) resyncs: AtomicU64,
    pub(crate) chunk_tokens: u32,
}

impl EventQueue {
    pub(crate) fn new(cap: usize, chunk_tokens: u32) -> EventQueue {
        EventQueue {
            records: Mutex::new(VecDeque::new()),
            cap,
            lost: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            published: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            chunk_tokens,
        }
    }

    /// Queues `r`, or drops it (counted) when the queue is full. Never
    /// waits on the publisher: the lock is held only to push or to swap
    /// the whole queue out.
    pub(crate) fn push(&self, r: Record) {
        let mut q = self.records.lock().expect("event queue lock");
        if q.len() < self.cap {
            q.push_back(r);
        } else {
            let state = !matches!(r, Record::Describe { .. });
            drop(q);
            // Relaxed: a counter.
            self.dropped.fetch_add(1, Ordering::Relaxed);
            if state {
                // Release pairs with the publisher's Acquire load in
                // `take`. (A DESCRIBE dropped loses token ids, not the
                // pool's state: its chunks' events go without them.)
                self.lost.store(true, Ordering::Release);
            }
        }
    }

    /// Everything queued, and whether a record was dropped since the last
    /// resync (the flag is cleared: the caller resyncs).
    pub(crate) fn take(&self) -> (VecDeque<Record>, bool) {
        let records = std::mem::take(&mut *self.records.lock().expect("event queue lock"));
        // Acquire pairs with the Release store in `push`.
        let lost = self.lost.swap(false, Ordering::Acquire);
        (records, lost)
    }
}
