//! The node's KV event stream (`kvring serve --kv-events`) with the real
//! `kvring` binary and real ZeroMQ sockets: a subscriber that applies the
//! events holds exactly the objects the pool holds, with the token ids of
//! each, after stores, evictions, a clear, a full queue and a restart; the
//! replay socket catches a late subscriber up and answers a snapshot.

mod common;

use common::tier::*;
use common::*;
use kvring::kv::{chunk_hashes, model_id, ChunkHash};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The events as a consumer decodes them (vLLM's fields, then kvring's).
#[derive(Deserialize, Debug)]
#[serde(tag = "type")]
enum Event {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        medium: Option<String>,
        #[serde(flatten)]
        object: Object,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        #[serde(flatten)]
        object: Object,
        to: Vec<String>,
    },
    AllBlocksCleared {},
}

#[derive(Deserialize, Debug, Clone, PartialEq)]
struct Object {
    model_id: u64,
    salt: u64,
    layout: u64,
    world_size: u32,
    rank: u32,
    #[serde(with = "serde_bytes")]
    chunk_hash: Vec<u8>,
}

#[derive(Deserialize, Debug)]
struct Batch(f64, Vec<Event>, Option<i32>);

/// What a subscriber believes the node holds.
#[derive(Clone, Debug)]
struct Held {
    object: Object,
    parent: Option<u64>,
    tokens: Vec<u32>,
}

/// A subscriber: SUB on the live socket, DEALER on the replay socket.
struct Subscriber {
    sub: zmq::Socket,
    dealer: zmq::Socket,
    _ctx: zmq::Context,
    /// The next sequence number expected.
    next: u64,
    held: HashMap<u64, Held>,
    cleared: u64,
    removed_to: Vec<Vec<String>>,
}

impl Subscriber {
    fn new(live: &str, replay: &str) -> Subscriber {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"kvring").unwrap();
        sub.connect(live).unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_rcvtimeo(5000).unwrap();
        dealer.connect(replay).unwrap();
        let mut s = Subscriber {
            sub,
            dealer,
            _ctx: ctx,
            next: 0,
            held: HashMap::new(),
            cleared: 0,
            removed_to: Vec::new(),
        };
        // Whatever was sent before the SUB joined comes from replay.
        s.replay(&0u64.to_be_bytes());
        s
    }

    /// Asks the replay socket (`ask`: a start sequence, or "snapshot") and
    /// applies the answer.
    fn replay(&mut self, ask: &[u8]) {
        self.dealer.send_multipart([&b""[..], ask], 0).unwrap();
        loop {
            let f = self.dealer.recv_multipart(0).expect("a replay answer");
            assert!(f[0].is_empty(), "an empty delimiter first: {f:?}");
            if f[2] == [0xff; 8] {
                assert_eq!(f.len(), 4, "the end marker");
                return;
            }
            assert_eq!(f.len(), 4, "[empty, topic, seq, batch]");
            assert_eq!(f[1], b"kvring");
            self.apply(u64::from_be_bytes(f[2][..].try_into().unwrap()), &f[3]);
        }
    }

    /// A live batch: a sequence that went back is a restarted server, a
    /// gap is batches missed; both are filled from the replay socket
    /// first.
    fn on_live(&mut self, seq: u64, payload: &[u8]) {
        if seq < self.next {
            self.next = 0;
            self.replay(&0u64.to_be_bytes());
        } else if seq > self.next {
            let next = self.next;
            self.replay(&next.to_be_bytes());
        }
        self.apply(seq, payload);
    }

    /// Applies batch `seq` unless it was applied already; a batch past the
    /// next expected one must be a resync.
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        let batch: Batch = rmp_serde::from_slice(payload).expect("a vLLM event batch");
        if seq < self.next {
            return;
        }
        assert!(
            seq == self.next || matches!(batch.1.first(), Some(Event::AllBlocksCleared {})),
            "a gap ({} to {seq}) not followed by a resync",
            self.next
        );
        assert!(batch.0 > 1.6e9, "a wall-clock time stamp");
        assert_eq!(batch.2, None);
        self.next = seq + 1;
        for ev in batch.1 {
            match ev {
                Event::AllBlocksCleared {} => {
                    self.held.clear();
                    self.cleared += 1;
                }
                Event::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    object,
                } => {
                    assert_eq!(block_size, CHUNK);
                    assert_eq!(medium.as_deref(), Some("CPU"));
                    assert_eq!(block_hashes.len(), 1);
                    let old = self.held.insert(
                        block_hashes[0],
                        Held {
                            object,
                            parent: parent_block_hash,
                            tokens: token_ids,
                        },
                    );
                    assert!(old.is_none(), "stored twice");
                }
                Event::BlockRemoved {
                    block_hashes,
                    medium,
                    object,
                    to,
                } => {
                    assert_eq!(medium.as_deref(), Some("CPU"));
                    let h = self
                        .held
                        .remove(&block_hashes[0])
                        .expect("removed, never stored");
                    assert_eq!(h.object, object);
                    self.removed_to.push(to);
                }
            }
        }
    }

    /// Applies what the live socket has for up to `wait`.
    fn poll(&mut self, wait: Duration) {
        let end = Instant::now() + wait;
        while self.sub.poll(zmq::POLLIN, 10).unwrap() > 0 || Instant::now() < end {
            while let Ok(f) = self.sub.recv_multipart(zmq::DONTWAIT) {
                assert_eq!(f.len(), 3, "[topic, seq, batch]");
                assert_eq!(f[0], b"kvring");
                self.on_live(u64::from_be_bytes(f[1][..].try_into().unwrap()), &f[2]);
            }
            if Instant::now() >= end {
                return;
            }
        }
    }

    fn chunks(&self) -> HashSet<ChunkHash> {
        self.held
            .values()
            .map(|h| h.object.chunk_hash[..].try_into().unwrap())
            .collect()
    }
}

/// A directory for the stream's sockets, removed on drop.
struct SockDir(std::path::PathBuf);

impl Drop for SockDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server with a 1 MiB pool (about 30 of the test's 32 KiB objects) and
/// an event stream on sockets in a directory of its own.
fn events_server(tag: &str, extra: &[&str]) -> (Fixture, SockDir, String, String) {
    let dir = std::env::temp_dir().join(format!("kvring-ev-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let live = format!("ipc://{}/live", dir.display());
    let replay = format!("ipc://{}/replay", dir.display());
    let args = [
        &[
            "--pool-bytes",
            "1MiB",
            "--kv-events",
            live.as_str(),
            "--kv-events-replay",
            replay.as_str(),
        ][..],
        extra,
    ]
    .concat();
    (server(tag, &[], &args), SockDir(dir), live, replay)
}

/// Describes and stores `n` chunks of prompt `seed`; returns each chunk's
/// hash with its token ids.
fn describe_and_store(e: &mut Engine, seed: u32, n: usize) -> Vec<(ChunkHash, Vec<u32>)> {
    let tokens = prompt(seed, n * CHUNK as usize);
    e.c.describe(model_id(MODEL), 0, CHUNK, &tokens, 0).unwrap();
    let hashes = store(e, seed, n);
    assert_eq!(hashes, chunk_hashes(&tokens, CHUNK));
    hashes
        .into_iter()
        .zip(tokens.chunks(CHUNK as usize).map(<[u32]>::to_vec))
        .collect()
}

/// Waits until the subscriber holds as many objects as the pool, and
/// checks each against what was stored.
fn agrees(sub: &mut Subscriber, e: &mut Engine, stored: &HashMap<ChunkHash, Vec<u32>>) {
    agrees_with(sub, e, stored, false)
}

/// As [`agrees`]; `lossy`: token ids may be missing (their DESCRIBE was
/// dropped from a full queue), never wrong.
fn agrees_with(
    sub: &mut Subscriber,
    e: &mut Engine,
    stored: &HashMap<ChunkHash, Vec<u32>>,
    lossy: bool,
) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        sub.poll(Duration::from_millis(50));
        let objects = stats(e).objects;
        if sub.held.len() as u64 == objects {
            break;
        }
        assert!(
            Instant::now() < end,
            "the subscriber holds {} objects, the pool {objects}",
            sub.held.len()
        );
    }
    let by_chunk: HashMap<ChunkHash, u64> = sub
        .held
        .iter()
        .map(|(b, h)| (h.object.chunk_hash[..].try_into().unwrap(), *b))
        .collect();
    for h in sub.held.values() {
        let chunk: ChunkHash = h.object.chunk_hash[..].try_into().unwrap();
        if !(lossy && h.tokens.is_empty()) {
            assert_eq!(
                Some(&h.tokens),
                stored.get(&chunk),
                "the token ids the chunk hash names"
            );
        }
        assert_eq!(h.object.model_id, model_id(MODEL));
        assert_eq!(
            (h.object.world_size, h.object.rank, h.object.salt),
            (1, 0, 0)
        );
        // The parent, when the pool holds it, is the chunk before.
        if let Some(p) = h.parent {
            if let Some(ph) = sub.held.get(&p) {
                let pc: ChunkHash = ph.object.chunk_hash[..].try_into().unwrap();
                assert!(by_chunk.contains_key(&pc));
            }
        }
    }
    // Every chunk the pool holds is one a lookup finds.
    for c in sub.chunks() {
        assert_eq!(lookup(&mut e.c, 1, 0, &[c]).hits(), 1);
    }
}

#[test]
fn a_subscriber_holds_what_the_pool_holds_through_evictions_a_clear_and_a_restart() {
    let (mut a, _dir, live, replay) = events_server("ev-main", &[]);
    let mut sub = Subscriber::new(&live, &replay);
    assert_eq!(sub.cleared, 1, "a server's stream starts with a resync");
    let mut e = engine(&a);
    let mut stored = HashMap::new();
    // 48 objects: the 1 MiB pool evicts.
    for seed in 0..12 {
        stored.extend(describe_and_store(&mut e, 100 + seed, 4));
    }
    agrees(&mut sub, &mut e, &stored);
    let s = stats(&mut e);
    assert!(s.evicted_objects >= 16, "{s:?}");
    assert!(sub.removed_to.len() as u64 >= s.evicted_objects);
    assert!(sub.removed_to.iter().all(Vec::is_empty), "no tier below");
    assert_eq!((s.events_dropped, s.events_resyncs), (0, 1), "{s:?}");
    assert!(s.events_published >= 48 + s.evicted_objects, "{s:?}");

    // A late subscriber, caught up by replay, agrees too.
    let mut late = Subscriber::new(&live, &replay);
    agrees(&mut late, &mut e, &stored);
    assert_eq!(
        late.held.keys().collect::<HashSet<_>>(),
        sub.held.keys().collect()
    );

    // A snapshot: "all cleared", then every object.
    let mut snap = Subscriber::new(&live, &replay);
    snap.replay(b"snapshot");
    assert_eq!(snap.cleared, 2);
    assert_eq!(
        snap.held.keys().collect::<HashSet<_>>(),
        sub.held.keys().collect()
    );

    // A clear removes every object.
    e.c.clear().unwrap();
    agrees(&mut sub, &mut e, &stored);
    assert!(sub.held.is_empty());

    // Stored again without a DESCRIBE: the events carry no token ids.
    let bare = store(&mut e, 500, 2);
    sub.poll(Duration::from_millis(200));
    for h in sub.held.values() {
        assert!(h.tokens.is_empty() && bare.contains(&h.object.chunk_hash[..].try_into().unwrap()));
    }

    // A restarted server starts its stream again from "all cleared".
    drop(e);
    a.srv.kill();
    let args: Vec<String> = server_args_of(&live, &replay);
    a.restart(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut e = engine(&a);
    // The subscriber notices at the next batch: its sequence went back.
    stored.extend(describe_and_store(&mut e, 900, 3));
    agrees(&mut sub, &mut e, &stored);
    assert_eq!(
        sub.held.len(),
        3,
        "the objects from before the restart are gone"
    );
}

/// The arguments `events_server` starts a server with (for a restart).
fn server_args_of(live: &str, replay: &str) -> Vec<String> {
    [
        "--chunk-tokens",
        "64",
        "--http",
        "off",
        "--pool-bytes",
        "1MiB",
        "--kv-events",
        live,
        "--kv-events-replay",
        replay,
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_full_queue_drops_records_and_a_resync_puts_the_subscriber_right() {
    // Two records fit: a store of 8 chunks overflows it.
    let (a, _dir, live, replay) = events_server("ev-full", &["--kv-events-queue", "2"]);
    let mut sub = Subscriber::new(&live, &replay);
    let mut e = engine(&a);
    let mut stored = HashMap::new();
    for seed in 0..6 {
        stored.extend(describe_and_store(&mut e, 200 + seed, 8));
    }
    agrees_with(&mut sub, &mut e, &stored, true);
    let s = stats(&mut e);
    assert!(s.events_dropped > 0, "{s:?}");
    assert!(s.events_resyncs >= 2, "{s:?}");
    assert!(sub.cleared >= 2);
}

#[test]
fn an_endpoint_that_cannot_be_bound_fails_the_start() {
    let s = Scope::new("ev-bind");
    let out = std::process::Command::new(kvring_bin())
        .args(["serve", "--name", &s.name, "--runtime-dir"])
        .arg(&s.dir)
        .args([
            "--http",
            "off",
            "--kv-events",
            "tcp://no-such-host.invalid:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--kv-events tcp://no-such-host.invalid:1"),
        "{err}"
    );
}
