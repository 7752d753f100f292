//! The publisher thread (`kvring-events`): drains the [`EventQueue`],
//! sends batches on the PUB socket as vLLM's publisher does (three frames:
//! topic, sequence number as 8 bytes big endian, msgpack batch), keeps the
//! last batches for replay, and answers the replay socket (ROUTER; clients
//! use DEALER): a request `[empty, start as 8 bytes big endian]` gets every
//! kept batch from `start` on as `[empty, topic, seq, batch]`, then the
//! end marker `[empty, empty, ff x 8, empty]`. A `start` older than the
//! oldest kept batch, or the request `snapshot`, first publishes a resync,
//! and the answer starts with it.
//!
//! Sequence numbers start at 0 with each start of the server, whose first
//! batch is a resync: a subscriber that sees the sequence go back, or a
//! gap, knows to start again from "all cleared".

use super::tokens::Tokens;
use super::wire::{self, Batch, Event, ObjectFields, MEDIUM_DISK, MEDIUM_POOL, MEDIUM_REMOTE};
use super::{EventQueue, EventsConfig, Record};
use crate::cache::{Level, Levels, ObjectKey};
use crate::kv_ops::KvState;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long the thread waits for a replay request before it drains the
/// queue again: the most an event waits to be sent.
const TICK: Duration = Duration::from_millis(5);
/// An idle stream sends an empty batch this often, so that a subscriber
/// learns of a restarted server (its sequence went back) or of batches it
/// missed without waiting for the next change.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Events in one batch at most.
const MAX_BATCH_EVENTS: usize = 1024;
/// Chunks described and not stored, kept at most (their token ids wait
/// for the store that follows a DESCRIBE).
const MAX_WAITING_CHUNKS: usize = 1 << 16;
/// The replay protocol's end marker (vLLM's: -1 as 8 bytes).
const END_SEQ: [u8; 8] = [0xff; 8];

/// The running publisher: stopped (its thread joined) on drop.
pub struct Publisher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Where the sockets are bound (a port 0 resolved) and the topic.
    bound: (String, Option<String>, String),
}

impl Publisher {
    /// Binds the sockets (an endpoint that cannot be bound fails the start)
    /// and starts the thread.
    pub(crate) fn start(
        cfg: &EventsConfig,
        queue: Arc<EventQueue>,
        kv: Arc<KvState>,
    ) -> Result<Publisher, String> {
        let ctx = zmq::Context::new();
        let pubs = ctx.socket(zmq::PUB).map_err(|e| e.to_string())?;
        pubs.set_sndhwm(cfg.hwm).map_err(|e| e.to_string())?;
        pubs.set_linger(0).map_err(|e| e.to_string())?;
        pubs.bind(&cfg.endpoint)
            .map_err(|e| format!("--kv-events {}: {e}", cfg.endpoint))?;
        let router = match &cfg.replay {
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER).map_err(|e| e.to_string())?;
                r.set_linger(0).map_err(|e| e.to_string())?;
                r.bind(ep)
                    .map_err(|e| format!("--kv-events-replay {ep}: {e}"))?;
                Some(r)
            }
            None => None,
        };
        let last = |s: &zmq::Socket| match s.get_last_endpoint() {
            Ok(Ok(e)) => e,
            _ => String::from("?"),
        };
        let bound = (last(&pubs), router.as_ref().map(last), cfg.topic.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let mut st = Stream {
            pubs,
            router,
            topic: cfg.topic.clone().into_bytes(),
            seq: 0,
            kept: VecDeque::new(),
            kept_bytes: 0,
            max_kept_bytes: cfg.replay_bytes,
            tokens: Tokens::new(queue.chunk_tokens, MAX_WAITING_CHUNKS),
            block_size: queue.chunk_tokens,
            last_sent: Instant::now(),
            queue,
            kv,
            _ctx: ctx,
        };
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvring-events".into())
            .spawn(move || st.run(&flag))
            .map_err(|e| format!("spawn the event publisher: {e}"))?;
        Ok(Publisher {
            stop,
            thread: Some(thread),
            bound,
        })
    }

    /// Where the sockets are bound, and the topic.
    pub fn endpoints(&self) -> (String, Option<String>, String) {
        self.bound.clone()
    }

    /// Stops the thread (it sends what is queued first).
    pub fn stop(&mut self) {
        // Release pairs with the thread's Acquire load in `run`.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread's state: the sockets, the sequence, the kept batches.
struct Stream {
    pubs: zmq::Socket,
    router: Option<zmq::Socket>,
    topic: Vec<u8>,
    /// The next batch's sequence number.
    seq: u64,
    /// The last batches sent, oldest first, for replay.
    kept: VecDeque<(u64, Vec<u8>)>,
    kept_bytes: u64,
    max_kept_bytes: u64,
    tokens: Tokens,
    block_size: u32,
    /// When the last batch was sent.
    last_sent: Instant,
    queue: Arc<EventQueue>,
    kv: Arc<KvState>,
    /// Declared last: dropped after the sockets.
    _ctx: zmq::Context,
}

fn fields(key: &ObjectKey) -> ObjectFields {
    ObjectFields {
        model_id: key.model_id,
        salt: key.salt,
        layout: key.fingerprint,
        world_size: key.rank_tag >> 16,
        rank: key.rank_tag & 0xffff,
        chunk_hash: key.hash,
    }
}

fn medium(l: Level) -> &'static str {
    match l {
        Level::Disk => MEDIUM_DISK,
        Level::Remote => MEDIUM_REMOTE,
    }
}

impl Stream {
    fn run(&mut self, stop: &AtomicBool) {
        self.resync();
        loop {
            // Acquire pairs with the Release store in `Publisher::stop`.
            let stopping = stop.load(Ordering::Acquire);
            let (records, lost) = self.queue.take();
            if lost {
                self.resync_after(records);
            } else {
                self.publish_records(records);
            }
            if self.last_sent.elapsed() >= HEARTBEAT {
                self.publish(&[]);
            }
            if stopping {
                return;
            }
            self.wait_and_serve_replay();
        }
    }

    /// Waits up to [`TICK`] for replay requests, and answers them.
    fn wait_and_serve_replay(&mut self) {
        let Some(router) = &self.router else {
            std::thread::sleep(TICK);
            return;
        };
        if router
            .poll(zmq::POLLIN, TICK.as_millis() as i64)
            .unwrap_or(0)
            == 0
        {
            return;
        }
        let mut requests = Vec::new();
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            requests.push(frames);
        }
        for frames in requests {
            self.answer(frames);
        }
    }

    /// One replay request (malformed ones are ignored: the socket is
    /// anyone's who can reach it).
    fn answer(&mut self, frames: Vec<Vec<u8>>) {
        let [id, empty, ask] = &frames[..] else {
            tracing::debug!(
                "kv events: a replay request of {} frames ignored",
                frames.len()
            );
            return;
        };
        if !empty.is_empty() {
            return;
        }
        let oldest = self.kept.front().map_or(self.seq, |(s, _)| *s);
        let start = match <[u8; 8]>::try_from(ask.as_slice()) {
            Ok(b) if b != *b"snapshot" && u64::from_be_bytes(b) >= oldest => u64::from_be_bytes(b),
            // Asked for a snapshot, or for batches no longer kept.
            Ok(_) => self.resync(),
            Err(_) => return,
        };
        let Some(router) = &self.router else { return };
        let first = self.kept.partition_point(|(s, _)| *s < start);
        for (seq, payload) in self.kept.range(first..) {
            let msg: [&[u8]; 5] = [id, b"", &self.topic, &seq.to_be_bytes(), payload];
            if router.send_multipart(msg, zmq::DONTWAIT).is_err() {
                // The client's queue is full or it is gone: it asks again.
                return;
            }
        }
        let end: [&[u8]; 5] = [id, b"", b"", &END_SEQ, b""];
        let _ = router.send_multipart(end, zmq::DONTWAIT);
    }

    /// A resync: "all cleared", then every object the pool holds, read
    /// under the cache's lock together with what is queued (so every
    /// record queued after it is newer than the objects read). Returns the
    /// sequence number of its first batch.
    fn resync(&mut self) -> u64 {
        self.resync_after(VecDeque::new())
    }

    /// A resync that supersedes `records` (taken off the queue before it).
    fn resync_after(&mut self, mut records: VecDeque<Record>) -> u64 {
        let (more, keys) = self
            .kv
            .with_cache(|c| (self.queue.take().0, c.ready_keys()));
        records.extend(more);
        // Only the token ids of what was queued still count: the objects
        // are read from the pool.
        for r in records {
            if let Record::Describe {
                model_id,
                salt,
                prev,
                tokens,
            } = r
            {
                self.tokens.describe(model_id, salt, prev, &tokens);
            }
        }
        self.tokens.recount();
        let mut events = Vec::with_capacity(keys.len() + 1);
        events.push(Event::AllBlocksCleared {});
        events.extend(keys.iter().map(|k| self.stored(k)));
        self.tokens.trim();
        // Relaxed: a counter.
        self.queue.resyncs.fetch_add(1, Ordering::Relaxed);
        let first = self.seq;
        self.publish(&events);
        first
    }

    /// Turns records into events and sends them.
    fn publish_records(&mut self, records: VecDeque<Record>) {
        if records.is_empty() {
            return;
        }
        let mut events = Vec::with_capacity(records.len());
        for r in records {
            match r {
                Record::Describe {
                    model_id,
                    salt,
                    prev,
                    tokens,
                } => self.tokens.describe(model_id, salt, prev, &tokens),
                Record::Stored(key) => events.push(self.stored(&key)),
                Record::Removed { key, to } => {
                    self.tokens.removed((key.model_id, key.salt, key.hash));
                    events.push(removed(&key, to));
                }
            }
        }
        if !events.is_empty() {
            self.publish(&events);
        }
    }

    /// The event of an object that became readable in the pool.
    fn stored(&mut self, key: &ObjectKey) -> Event {
        let object = fields(key);
        let (parent, token_ids) = match self.tokens.stored((key.model_id, key.salt, key.hash)) {
            Some((parent, tokens)) => (
                parent.map(|p| object.with_chunk(p).block_hash()),
                tokens.to_vec(),
            ),
            // Not described (the engine does not describe, or the
            // DESCRIBE was dropped): the event carries no token ids.
            None => (None, Vec::new()),
        };
        Event::BlockStored {
            block_hashes: [object.block_hash()],
            parent_block_hash: parent,
            token_ids,
            block_size: self.block_size,
            lora_id: None,
            medium: MEDIUM_POOL,
            lora_name: None,
            object,
        }
    }

    /// Sends `events` in batches of at most [`MAX_BATCH_EVENTS`].
    /// No events: an empty batch (a heartbeat).
    fn publish(&mut self, events: &[Event]) {
        self.last_sent = Instant::now();
        let parts: Vec<&[Event]> = if events.is_empty() {
            vec![&[]]
        } else {
            events.chunks(MAX_BATCH_EVENTS).collect()
        };
        for part in parts {
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let payload = wire::encode(&Batch(ts, part, None));
            let seq = self.seq;
            self.seq += 1;
            let msg: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
            // A PUB socket never blocks: past a subscriber's high-water
            // mark it drops that subscriber's messages.
            if let Err(e) = self.pubs.send_multipart(msg, zmq::DONTWAIT) {
                tracing::debug!("kv events: batch {seq} not sent: {e}");
            }
            // Relaxed: a counter.
            self.queue
                .published
                .fetch_add(part.len() as u64, Ordering::Relaxed);
            if self.router.is_some() {
                self.kept_bytes += payload.len() as u64;
                self.kept.push_back((seq, payload));
                while self.kept_bytes > self.max_kept_bytes && self.kept.len() > 1 {
                    let (_, old) = self.kept.pop_front().expect("more than one kept");
                    self.kept_bytes -= old.len() as u64;
                }
            }
        }
    }
}

/// The event of an object that left the pool.
fn removed(key: &ObjectKey, to: Levels) -> Event {
    let object = fields(key);
    Event::BlockRemoved {
        block_hashes: [object.block_hash()],
        medium: MEDIUM_POOL,
        object,
        to: to.iter().map(medium).collect(),
    }
}
