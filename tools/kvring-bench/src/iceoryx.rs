//! iceoryx2 peers, each between this process and a forked child, both sides
//! busy-polling (iceoryx2's fastest mode; a WaitSet would add syscalls).
//!
//! - [`pubsub`]: the fastest round trip its users build, and the shape of its
//!   own latency benchmark: a ping service and a pong service, each with one
//!   publisher and one subscriber, samples loaned ahead of time and written in
//!   place (`loan_uninit` / `write_payload` / `send`). This is also the shape of
//!   a kvring client and server: one SPSC queue each way.
//! - [`request_response`]: RPC with a response channel tracked per request.
//!   As shipped (default QoS, `send_copy` on both sides), or tuned (minimal QoS
//!   for one client and one server, the next request loaned while the current
//!   one is in flight, the reply written into a loaned response).
//!
//! The payload is 64 bytes (`[u64; 8]`) each way; the echo is checked.

use crate::peers::{cpus, fork_child, pin, reap, sample};
use iceoryx2::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

type Msg = [u64; 8];

/// Polls between two clock reads: the deadline is checked rarely so the
/// poll loop costs what the transport costs.
const SPINS_PER_CLOCK_READ: u32 = 4096;

/// How long a round trip may take once both sides are connected.
const LOST: Duration = Duration::from_secs(5);

/// Marks the last message: the child echoes it and exits.
const STOP: u64 = u64::MAX;

/// Busy-polls `f` until it yields something or `limit` has passed.
fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t = Instant::now();
    loop {
        for _ in 0..SPINS_PER_CLOCK_READ {
            if let Some(v) = f() {
                return Some(v);
            }
            std::hint::spin_loop();
        }
        if t.elapsed() > limit {
            return None;
        }
    }
}

/// A service name no other run or block uses.
fn service_name(shape: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // Relaxed: a counter that only has to hand out distinct values.
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("kvring-bench/{}/{n}/{shape}", std::process::id())
}

/// Round trips until the first one is answered (until both sides have
/// connected, a message may go to nobody), then the timed ones.
fn connect_then_sample(iters: usize, mut round: impl FnMut(u64, Duration) -> bool) -> Vec<u64> {
    let t = Instant::now();
    let mut word = 0u64;
    loop {
        word += 1;
        if round(word, Duration::from_millis(20)) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "iceoryx2 peer never answered"
        );
    }
    let v = sample(iters, || {
        word += 1;
        assert!(round(word, LOST), "iceoryx2 round trip lost");
    });
    let _ = round(STOP, Duration::from_secs(1));
    v
}

/// Publish-subscribe ping/pong with loaned samples.
pub fn pubsub(iters: usize) -> Vec<u64> {
    let ping_name = service_name("ping");
    let pong_name = service_name("pong");
    let (ping_child, pong_child) = (ping_name.clone(), pong_name.clone());
    let child = fork_child(move || {
        let node = NodeBuilder::new().create::<ipc::Service>().unwrap();
        let (ping, pong) = (
            pubsub_service(&node, &ping_child),
            pubsub_service(&node, &pong_child),
        );
        let requests = ping.subscriber_builder().create().unwrap();
        let replies = pong.publisher_builder().create().unwrap();
        let mut next = replies.loan_uninit().unwrap();
        loop {
            let Some(msg) = requests.receive().unwrap() else {
                std::hint::spin_loop();
                continue;
            };
            let p = *msg.payload();
            next.write_payload(p).send().unwrap();
            // Released after the reply is on its way, not before.
            drop(msg);
            if p[0] == STOP {
                break;
            }
            next = replies.loan_uninit().unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
    });
    pin(cpus().0);
    let node = NodeBuilder::new().create::<ipc::Service>().unwrap();
    let (ping, pong) = (
        pubsub_service(&node, &ping_name),
        pubsub_service(&node, &pong_name),
    );
    let requests = ping.publisher_builder().create().unwrap();
    let replies = pong.subscriber_builder().create().unwrap();
    let mut next = Some(requests.loan_uninit().unwrap());
    let v = connect_then_sample(iters, |word, limit| {
        let msg = [word; 8];
        let loaned = next.take().expect("a loaned sample is always ready");
        loaned.write_payload(msg).send().unwrap();
        // The next loan is taken while the peer works, as iceoryx2's own
        // benchmark does.
        next = Some(requests.loan_uninit().unwrap());
        // A reply to an earlier, timed-out message is skipped.
        poll(limit, || {
            replies
                .receive()
                .unwrap()
                .filter(|r| r.payload()[0] == word)
        })
        .map(|r| assert_eq!(*r.payload(), msg, "echo differs"))
        .is_some()
    });
    drop(next);
    reap(child);
    v
}

/// Request-response: `tuned` as described in the module documentation;
/// otherwise as shipped (default QoS, `send_copy`).
pub fn request_response(iters: usize, tuned: bool) -> Vec<u64> {
    let name = service_name(if tuned { "rr-tuned" } else { "rr" });
    let name_child = name.clone();
    let child = fork_child(move || {
        let node = NodeBuilder::new().create::<ipc::Service>().unwrap();
        let service = rr_service(&node, &name_child, tuned);
        let server = service.server_builder().create().unwrap();
        loop {
            let Some(req) = server.receive().unwrap() else {
                std::hint::spin_loop();
                continue;
            };
            let p = *req.payload();
            if tuned {
                req.loan_uninit().unwrap().write_payload(p).send().unwrap();
            } else {
                req.send_copy(p).unwrap();
            }
            drop(req);
            if p[0] == STOP {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    });
    pin(cpus().0);
    let node = NodeBuilder::new().create::<ipc::Service>().unwrap();
    let service = rr_service(&node, &name, tuned);
    let client = service.client_builder().create().unwrap();
    let mut next = if tuned {
        Some(client.loan_uninit().unwrap())
    } else {
        None
    };
    let v = connect_then_sample(iters, |word, limit| {
        let msg = [word; 8];
        let pending = match next.take() {
            Some(loaned) => {
                let pending = loaned.write_payload(msg).send().unwrap();
                // The next request is loaned while this one is in flight.
                next = Some(client.loan_uninit().unwrap());
                pending
            }
            None => client.send_copy(msg).unwrap(),
        };
        poll(limit, || pending.receive().unwrap())
            .map(|r| assert_eq!(*r.payload(), msg, "echo differs"))
            .is_some()
    });
    drop(next);
    reap(child);
    v
}

type PubSubFactory =
    iceoryx2::service::port_factory::publish_subscribe::PortFactory<ipc::Service, Msg, ()>;

/// One direction of the ping/pong pair, with the QoS iceoryx2's own latency
/// benchmark uses: no history, a one-sample buffer that overwrites, one
/// publisher and one subscriber.
fn pubsub_service(node: &Node<ipc::Service>, name: &str) -> PubSubFactory {
    node.service_builder(&name.try_into().unwrap())
        .publish_subscribe::<Msg>()
        .history_size(0)
        .subscriber_max_buffer_size(1)
        .enable_safe_overflow(true)
        .max_publishers(1)
        .max_subscribers(1)
        .open_or_create()
        .unwrap()
}

type RrFactory =
    iceoryx2::service::port_factory::request_response::PortFactory<ipc::Service, Msg, (), Msg, ()>;

fn rr_service(node: &Node<ipc::Service>, name: &str, tuned: bool) -> RrFactory {
    let builder = node
        .service_builder(&name.try_into().unwrap())
        .request_response::<Msg, Msg>();
    let builder = if tuned {
        // Room for exactly one client, one server and one request in flight.
        builder
            .max_servers(1)
            .max_clients(1)
            .max_nodes(2)
            .max_response_buffer_size(1)
            .max_active_requests_per_client(1)
            .max_borrowed_responses_per_pending_response(1)
    } else {
        builder
    };
    builder.open_or_create().unwrap()
}
