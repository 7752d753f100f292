//! The server's HTTP endpoint (`kvring serve --http ADDR`): Prometheus
//! metrics, a liveness probe that sees a stall, a readiness probe, the
//! inspector's JSON and the operator's admin calls. One thread
//! (`kvring-http`, a single-threaded Tokio runtime) serves every
//! connection from the segment as the inspector reads it: its own
//! read-only mapping, the same snapshot and anomaly checks
//! ([`kvring::inspect`]), and no lock the ring loop, the acceptor or a copy
//! worker takes. The admin calls, which take the cache's lock, run one at a
//! time on a thread of their own (`kvring-http-admin`), never on the one
//! that answers the probes.
//!
//! Connections are served concurrently, and each is bounded. One request
//! per connection (`Connection: close`), read within [`CLIENT_DEADLINE`]
//! and at most [`REQUEST_LIMIT`] bytes, however slowly it trickles in (a
//! malformed request is answered 400, one too large 413, a slow or silent
//! client 408 at the deadline); the answer is written within
//! [`CLIENT_DEADLINE`] too, then the connection is closed. At most
//! [`HttpConfig::max_connections`] are open ([`DEFAULT_MAX_CONNECTIONS`],
//! and never more than a quarter of the process's open-descriptor limit:
//! the rest is the engines' registrations'). A connection past the bound,
//! or one that finds no descriptor left, makes room by closing the oldest
//! connection that waits on its client (still sending its request, or not
//! taking its answer), which is answered 503: idle, slow and half-open
//! clients cannot keep a probe out, and a new connection waits for none of
//! them. When every connection is being answered (a bounded wait) a new
//! one is answered 503 at once. An accept that fails is retried after a
//! pause, never in a loop. The request reader ([`RequestReader`]) does no
//! I/O: its answer is a function of the bytes received, however they are
//! split (the `http_request` fuzz target checks it).
//!
//! * `GET /metrics`: the metrics of a reading ([`crate::metrics::openmetrics`]
//!   when the client accepts OpenMetrics, as Prometheus does, else
//!   Prometheus's text format 0.0.4).
//! * `GET /healthz`: two readings 100 ms apart (the connection waits, the
//!   others are served meanwhile); 200 and `{"status":"ok"}`, or 200 and
//!   `{"status":"degraded", "reasons": [...]}` while a tier below the pool
//!   is down (the pool serves), unless the reading shows a stall (503,
//!   `{"status":"unhealthy", "reasons": [...]}`): the heartbeat stopped (the acceptor keeps it), a request
//!   ring with bytes waiting whose head did not move (the ring loop), a
//!   copy worker with work that made no step for longer than the
//!   stalled-lane bound (a wedged copy, a stopped thread), a job unfinished
//!   for longer than the stuck-job bound (an engine event that never
//!   completes), or words that contradict each other.
//! * `GET /readyz`: 200 while the server is `running` (accepting clients)
//!   and its whole pool is ready for copies (pinned, with the CUDA
//!   backend, which pins it 1 GiB at a time after the start), else 503.
//! * `GET /status`: the inspector's `show --json` object.
//! * Admin: `POST /clear` (drops every object no lease holds and no pin
//!   covers, as CLEAR) and `POST /evict?bytes=N` (evicts at least N bytes
//!   of such objects, least recently used first), both answering
//!   `{"objects": n, "bytes": b}` of what went; `POST /pin` and `POST
//!   /unpin` with a JSON body `{"model_id": M, "salt": S, "hashes": ["<32
//!   hex digits>", ...]}` (M and S: a number or a `"0x..."` hex string; S
//!   optional, 0) add or remove the pins of those chunks
//!   ([`super::cache::Pin`]: their objects of any fingerprint and rank,
//!   stored now or later, are neither evicted nor cleared), answering
//!   `{"pins", "objects", "bytes", "matched"}` ([`super::cache::PinCount`]);
//!   `GET /pins` lists the pins. These take the cache's lock for their
//!   work, as a client's CLEAR does.
//!
//! Who may do what: the read-only calls answer whoever can connect (the
//! default address is loopback). An admin call needs the server's admin
//! token, `Authorization: Bearer <token>`: 64 hex digits (32 bytes of the
//! OS's random source, drawn at each start) in
//! `<runtime dir>/<name>.admin-token`
//! ([`kvring::rundir::ServerPaths::admin_token`]), mode 0600 in the 0700
//! runtime directory, so only the server's user (and root) can read it,
//! like the segment itself; it is compared in constant time, and is
//! removed at a clean stop. Without it (or with another) the call is
//! answered 401, saying where the token is. From a peer other than
//! loopback, admin calls are refused (403) unless `admin_remote`, and then
//! still need the token (which crosses the network in clear text).

mod pins;
mod request;
mod response;
mod routes;
mod slots;
mod token;

pub(crate) use request::{Request, RequestReader, Step};
pub(crate) use response::Response;

use kvring::inspect::{self, Thresholds};
use kvring::segment::ReadOnlySegment;
use routes::Endpoint;
use slots::{Slot, Slots};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use token::AdminToken;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How long a client has to send its request, and to take the answer.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// The largest request read (method, path, headers and body).
pub const REQUEST_LIMIT: usize = 16 * 1024;
/// The default address: loopback, Prometheus's conventional exporter port.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9090";
/// The default bound on the endpoint's open connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// After the answer, what the client still sends is read (and dropped)
/// for this long and this much at most: closing with unread bytes would
/// reset the connection before the client read the answer.
const DRAIN_TIME: Duration = Duration::from_millis(100);
const DRAIN_LIMIT: usize = 64 * 1024;
/// The pause after an accept that failed with nothing to close.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Connections the kernel completes before they are accepted (capped by
/// `net.core.somaxconn`): a burst waits for the accept loop instead of
/// being dropped.
const LISTEN_BACKLOG: i32 = 1024;
/// The connections of a full endpoint that is answering every one.
const BUSY: &str = "too many connections: every one is being answered; try again\n";
/// The oldest connection waiting on its client, closed to make room.
const CLOSED_FOR_ROOM: &str =
    "too many connections: this one, the oldest waiting on its client, was closed to make room\n";

/// The endpoint's settings.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    pub addr: SocketAddr,
    /// Fail the start when the address cannot be bound (the operator asked
    /// for it); otherwise the server runs without the endpoint, saying why.
    pub required: bool,
    /// A job unfinished for longer than this makes `/healthz` unhealthy.
    pub stuck_job: Duration,
    /// A copy worker with work that made no step for longer than this
    /// makes `/healthz` unhealthy.
    pub stalled_lane: Duration,
    /// Accept the admin calls (still with the token) from peers other than
    /// loopback.
    pub admin_remote: bool,
    /// At most this many connections open; never more than a quarter of
    /// the process's open-descriptor limit.
    pub max_connections: usize,
}

impl HttpConfig {
    /// The default endpoint, not required.
    pub fn default_endpoint() -> HttpConfig {
        HttpConfig {
            addr: DEFAULT_ADDR.parse().expect("a socket address"),
            required: false,
            stuck_job: Duration::from_secs(60),
            stalled_lane: Duration::from_secs_f64(inspect::DEFAULT_LANE_STALL_S),
            admin_remote: false,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The endpoint's address bound and its admin token written. The server
/// makes it before its socket exists, so that whoever finds the server can
/// read the token, and a required address that is taken fails the start
/// before anything else; dropped unstarted (a start that failed later), it
/// removes the token.
pub(crate) struct Bound {
    listener: TcpListener,
    token: AdminToken,
}

/// The running endpoint: stopped and joined on drop, its admin token
/// removed.
pub(crate) struct HttpServer {
    stop: Arc<Notify>,
    thread: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
    token_path: PathBuf,
}

impl HttpServer {
    /// Binds `cfg.addr` (before the server's threads start, so a required
    /// address that is taken fails the start cleanly).
    pub fn bind(cfg: &HttpConfig) -> std::io::Result<TcpListener> {
        let l = TcpListener::bind(cfg.addr)?;
        // The standard library listens with a queue of 128; listening
        // again sets a deeper one.
        nix::sys::socket::listen(&l, nix::sys::socket::Backlog::new(LISTEN_BACKLOG)?)?;
        l.set_nonblocking(true)?;
        Ok(l)
    }

    /// Writes the admin token (to `token_path`) of the endpoint bound to
    /// `listener`.
    pub fn prepare(listener: TcpListener, token_path: &Path) -> crate::Result<Bound> {
        Ok(Bound {
            listener,
            token: AdminToken::create(token_path)?,
        })
    }

    /// Serves on the bound endpoint from the segment `shm_name`; admin
    /// calls act on the cache service `kv` and need the bound token.
    pub fn start(
        bound: Bound,
        shm_name: &str,
        cfg: &HttpConfig,
        kv: Arc<crate::kv_ops::KvState>,
    ) -> crate::Result<HttpServer> {
        let Bound { listener, token } = bound;
        let token_path = token.path().to_path_buf();
        let seg = ReadOnlySegment::open_shm(shm_name)?;
        let addr = listener
            .local_addr()
            .map_err(kvring::error::io("the HTTP endpoint's address"))?;
        let th = Thresholds {
            job_age_s: cfg.stuck_job.as_secs_f64(),
            lane_stall_s: cfg.stalled_lane.as_secs_f64(),
        };
        let max_connections = connection_bound(cfg.max_connections);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            // The admin calls: one at a time, on a thread of their own.
            .max_blocking_threads(1)
            .thread_name("kvring-http-admin")
            .build()
            .map_err(kvring::error::io("start the HTTP endpoint's runtime"))?;
        let ep = Arc::new(Endpoint {
            seg,
            th,
            prev: Mutex::new(None),
            kv,
            admin_remote: cfg.admin_remote,
            token,
        });
        let stop = Arc::new(Notify::new());
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvring-http".into())
            .spawn(move || {
                rt.block_on(serve(listener, ep, max_connections, &s));
                // An admin call still running finishes (the server's other
                // threads still run: the endpoint stops first).
                rt.shutdown_timeout(Duration::from_secs(5));
            });
        let thread = match thread {
            Ok(t) => t,
            // (The token, dropped with the endpoint, removes its file.)
            Err(e) => return Err(kvring::error::io("spawn the HTTP thread")(e)),
        };
        Ok(HttpServer {
            stop,
            thread: Some(thread),
            addr,
            token_path,
        })
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        // A permit is stored when the accept loop is not waiting: it stops
        // at its next turn either way.
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // No admin call is taken any more.
        let _ = std::fs::remove_file(&self.token_path);
    }
}

/// The bound on open connections: `configured`, but at most a quarter of
/// this process's open-descriptor limit (which the server raised to its
/// hard limit at the start).
fn connection_bound(configured: usize) -> usize {
    use nix::sys::resource::{getrlimit, Resource};
    let fds = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
    let cap = usize::try_from(fds / 4).unwrap_or(usize::MAX).max(16);
    let n = configured.clamp(1, cap);
    if n < configured {
        tracing::warn!(
            "HTTP endpoint: at most {n} connections, not {configured}: a quarter of the open-descriptor limit ({fds})"
        );
    } else {
        tracing::info!("HTTP endpoint: at most {n} connections (open-descriptor limit {fds})");
    }
    n
}

/// `m`'s guard; a panic that poisoned it left a value still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Accepts connections until `stop` is notified, a task each.
async fn serve(listener: TcpListener, ep: Arc<Endpoint>, max: usize, stop: &Notify) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("the HTTP endpoint cannot serve: {e}");
            return;
        }
    };
    let slots = Slots::new(max);
    let busy = Response::text(503, BUSY).to_bytes();
    let mut warned: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = stop.notified() => return,
            r = listener.accept() => r,
        };
        let e = match accepted {
            Ok((stream, peer)) => {
                if let Some(slot) = Slots::admit(&slots) {
                    tokio::spawn(connection(stream, peer, ep.clone(), slot));
                } else {
                    // (Best effort: the connection is new, its buffer empty.)
                    let _ = stream.try_write(&busy);
                }
                continue;
            }
            Err(e) => e,
        };
        let no_descriptor = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        if no_descriptor && lock(&slots).close_oldest() {
            // The closed connection's task frees its descriptor when it
            // runs: let it, then accept again.
            tokio::task::yield_now().await;
            continue;
        }
        if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!("HTTP accept: {e} (retrying every {ACCEPT_BACKOFF:?})");
            warned = Some(Instant::now());
        }
        tokio::select! {
            () = stop.notified() => return,
            () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
        }
    }
}

/// Serves one connection: reads its request within the deadline, answers
/// it, closes. Closed early to make room while it waits on its client.
async fn connection(mut stream: TcpStream, peer: SocketAddr, ep: Arc<Endpoint>, mut slot: Slot) {
    let loopback = peer.ip().to_canonical().is_loopback();
    let by = tokio::time::Instant::now() + CLIENT_DEADLINE;
    let read = tokio::select! {
        () = slot.closed_for_room() => {
            let _ = stream.try_write(&Response::text(503, CLOSED_FOR_ROOM).to_bytes());
            return;
        }
        r = read_request(&mut stream, by) => r,
    };
    if !slot.hold() {
        let _ = stream.try_write(&Response::text(503, CLOSED_FOR_ROOM).to_bytes());
        return;
    }
    let resp = match read {
        Ok(req) => ep.route(req, loopback).await,
        Err(r) => r,
    };
    slot.release();
    let answer = resp.to_bytes();
    tokio::select! {
        () = slot.closed_for_room() => {}
        () = write_answer(&mut stream, &answer) => {}
    }
}

/// Reads a request from `stream` by `by`: the request, or the answer that
/// refuses it.
async fn read_request(
    stream: &mut TcpStream,
    by: tokio::time::Instant,
) -> Result<Request, Response> {
    let late = || Response::text(408, "request not received in time\n");
    let mut reader = RequestReader::default();
    loop {
        match tokio::time::timeout_at(by, stream.readable()).await {
            Err(_) => return Err(late()),
            Ok(Err(_)) => return Err(Response::text(400, "unreadable request\n")),
            Ok(Ok(())) => {}
        }
        // (Not kept across a wait: an idle connection holds no buffer.)
        let mut chunk = [0u8; 2048];
        let room = reader.room().min(chunk.len());
        let step = match stream.try_read(&mut chunk[..room]) {
            Ok(n) => reader.push(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                continue
            }
            Err(_) => return Err(Response::text(400, "unreadable request\n")),
        };
        match step {
            Step::More => {}
            Step::SendContinue => {
                let interim = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
                if tokio::time::timeout_at(by, interim).await.is_err() {
                    return Err(late());
                }
            }
            Step::Done(r) => return r,
        }
    }
}

/// Writes `answer` within the deadline, closes the sending side, and reads
/// what the client still sends for a moment (boundedly).
async fn write_answer(stream: &mut TcpStream, answer: &[u8]) {
    let written = tokio::time::timeout(CLIENT_DEADLINE, async {
        stream.write_all(answer).await?;
        stream.shutdown().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return;
    }
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut sink = vec![0u8; 4096];
        let mut left = DRAIN_LIMIT;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(n) if n > 0 => left = left.saturating_sub(n),
                _ => break,
            }
        }
    })
    .await;
}
