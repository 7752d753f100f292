//! The server's HTTP endpoint (`kvring serve --http ADDR`): Prometheus
//! metrics, a liveness probe that sees a stall, a readiness probe, the
//! inspector's JSON and the operator's admin calls. One thread
//! (`kvring-http`, a single-threaded Tokio runtime) serves every
//! connection from the segment as the inspector reads it: its own
//! read-only mapping, the same snapshot and anomaly checks
//! ([`crate::inspect`]), and no lock the ring loop, the acceptor or a copy
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
//! * `GET /metrics`: the metrics of a reading ([`crate::inspect::openmetrics`]
//!   when the client accepts OpenMetrics, as Prometheus does, else
//!   Prometheus's text format 0.0.4).
//! * `GET /healthz`: two readings 100 ms apart (the connection waits, the
//!   others are served meanwhile); 200 and `{"status":"ok"}` unless the
//!   reading shows a stall (503, `{"status":"unhealthy", "reasons":
//!   [...]}`): the heartbeat stopped (the acceptor keeps it), a request
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
//! ([`crate::rundir::ServerPaths::admin_token`]), mode 0600 in the 0700
//! runtime directory, so only the server's user (and root) can read it,
//! like the segment itself; it is compared in constant time, and is
//! removed at a clean stop. Without it (or with another) the call is
//! answered 401, saying where the token is. From a peer other than
//! loopback, admin calls are refused (403) unless `admin_remote`, and then
//! still need the token (which crosses the network in clear text).

use super::cache::{Pin, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE};
use crate::inspect::{self, AnomalyKind, Snapshot, Thresholds};
use crate::segment::ReadOnlySegment;
use crate::shm::ServerState;
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
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
/// Two readings this far apart show a ring that stopped moving.
const STALL_SAMPLE: Duration = Duration::from_millis(100);
/// How long an admin call may wait for its turn and do its work before
/// its client is answered 503 (the call itself then still finishes).
const ADMIN_DEADLINE: Duration = Duration::from_secs(30);
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
const CLOSED_FOR_ROOM: &str = "too many connections: this one, the oldest waiting on its client, was closed to make room\n";

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

    /// Serves on `listener` from the segment `shm_name`; admin calls act
    /// on `shared`'s cache and need the token written to `token_path`.
    pub fn start(
        listener: TcpListener,
        shm_name: &str,
        token_path: &Path,
        cfg: &HttpConfig,
        shared: Arc<super::Shared>,
    ) -> crate::Result<HttpServer> {
        let seg = ReadOnlySegment::open_shm(shm_name)?;
        let addr = listener
            .local_addr()
            .map_err(crate::error::io("the HTTP endpoint's address"))?;
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
            .map_err(crate::error::io("start the HTTP endpoint's runtime"))?;
        let token = AdminToken::create(token_path)?;
        let ep = Arc::new(Endpoint {
            seg,
            th,
            prev: Mutex::new(None),
            shared,
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
            Err(e) => {
                let _ = std::fs::remove_file(token_path);
                return Err(crate::error::io("spawn the HTTP thread")(e));
            }
        };
        Ok(HttpServer {
            stop,
            thread: Some(thread),
            addr,
            token_path: token_path.to_path_buf(),
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

/// A response: status, content type, body.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Response(u16, &'static str, Vec<u8>);

impl Response {
    fn text(code: u16, body: &str) -> Response {
        Response(code, "text/plain; charset=utf-8", body.as_bytes().to_vec())
    }

    fn json(code: u16, v: &impl serde::Serialize) -> Response {
        let body = serde_json::to_vec(v).expect("serializable");
        Response(code, "application/json", body)
    }

    /// The status code.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn code(&self) -> u16 {
        self.0
    }

    /// The whole answer: status line, headers, body.
    fn to_bytes(&self) -> Vec<u8> {
        let challenge = if self.0 == 401 {
            "WWW-Authenticate: Bearer realm=\"kvring admin\"\r\n"
        } else {
            ""
        };
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\n{challenge}\r\n",
            self.0,
            reason(self.0),
            self.1,
            self.2.len()
        )
        .into_bytes();
        out.extend_from_slice(&self.2);
        out
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// `m`'s guard; a panic that poisoned it left a value still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Endpoint {
    seg: ReadOnlySegment,
    th: Thresholds,
    /// The last reading, to compare the next one with (rings that did not
    /// move between them).
    prev: Mutex<Option<Snapshot>>,
    /// The server's state, for the admin calls only.
    shared: Arc<super::Shared>,
    admin_remote: bool,
    token: AdminToken,
}

impl Endpoint {
    async fn route(self: Arc<Self>, req: Request, loopback: bool) -> Response {
        let method = req.method.as_str();
        let (path, query) = req.path.split_once('?').unwrap_or((&req.path, ""));
        if matches!(path, "/clear" | "/evict" | "/pin" | "/unpin" | "/pins") {
            let allowed = if path == "/pins" { "GET" } else { "POST" };
            if method != allowed {
                return Response::text(405, &format!("only {allowed}\n"));
            }
            if !loopback && !self.admin_remote {
                return Response::text(403, "admin calls are taken from loopback only\n");
            }
            if !self.token.admits(req.bearer.as_deref()) {
                return self.token.refusal();
            }
            let (path, query) = (path.to_string(), query.to_string());
            let body = req.body;
            let ep = self.clone();
            let call =
                tokio::task::spawn_blocking(move || ep.admin(&path, &query, body.as_deref()));
            return match tokio::time::timeout(ADMIN_DEADLINE, call).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => Response::text(500, &format!("the admin call failed: {e}\n")),
                Err(_) => Response::text(
                    503,
                    &format!(
                        "the admin call did not finish within {} s (it still may)\n",
                        ADMIN_DEADLINE.as_secs()
                    ),
                ),
            };
        }
        if !matches!(path, "/metrics" | "/healthz" | "/readyz" | "/status") {
            return Response::text(
                404,
                "not found: GET /metrics, /healthz, /readyz, /status, /pins; POST /clear, /evict?bytes=N, /pin, /unpin\n",
            );
        }
        if method != "GET" {
            return Response::text(405, "only GET\n");
        }
        match path {
            "/metrics" => {
                let s = self.reading(None);
                if req.openmetrics {
                    Response(
                        200,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        inspect::openmetrics(&s).into_bytes(),
                    )
                } else {
                    Response(
                        200,
                        "text/plain; version=0.0.4; charset=utf-8",
                        inspect::prometheus_text(&s).into_bytes(),
                    )
                }
            }
            "/status" => Response::json(200, &self.reading(None)),
            "/readyz" => {
                let s = inspect::snapshot(&self.seg, self.th);
                let running =
                    s.server.alive && s.server.state.known() == Some(ServerState::Running);
                let pool_ready = s.server.pool_ready_bytes >= s.cache.pool_bytes;
                let ready = running && pool_ready;
                Response::json(
                    if ready { 200 } else { 503 },
                    &serde_json::json!({
                        "ready": ready,
                        "state": s.server.state,
                        "pool_bytes": s.cache.pool_bytes,
                        "pool_ready_bytes": s.server.pool_ready_bytes,
                    }),
                )
            }
            _ => {
                // `/healthz`: two readings apart, always; the other
                // connections are served while this one waits.
                let first = inspect::snapshot(&self.seg, self.th);
                tokio::time::sleep(STALL_SAMPLE).await;
                let s = self.reading(Some(&first));
                let reasons: Vec<_> = s
                    .anomalies
                    .iter()
                    .filter(|a| {
                        matches!(
                            a.kind,
                            AnomalyKind::HeartbeatStopped
                                | AnomalyKind::RingStalled
                                | AnomalyKind::JobStuck
                                | AnomalyKind::LaneStalled
                                | AnomalyKind::Inconsistent
                                | AnomalyKind::ServerDead
                        )
                    })
                    .collect();
                let ok = reasons.is_empty();
                Response::json(
                    if ok { 200 } else { 503 },
                    &serde_json::json!({
                        "status": if ok { "ok" } else { "unhealthy" },
                        "reasons": reasons,
                        "heartbeat_age_ms": s.server.heartbeat_age_ms,
                        "stuck_job_s": self.th.job_age_s,
                        "stalled_lane_s": self.th.lane_stall_s,
                    }),
                )
            }
        }
    }

    /// `POST /clear`, `POST /evict?bytes=N`, `POST /pin`, `POST /unpin`,
    /// `GET /pins`.
    fn admin(&self, path: &str, query: &str, body: Option<&[u8]>) -> Response {
        let sh = &self.shared;
        if matches!(path, "/pin" | "/unpin") {
            let pins = match parse_pins(body) {
                Ok(p) => p,
                Err((code, e)) => {
                    return Response::text(code, &format!("POST {path}: {e}\n{PIN_BODY}\n"))
                }
            };
            if path == "/unpin" {
                return Response::json(200, &sh.kv.with_cache(sh, |c| c.unpin(&pins)));
            }
            let got = sh.kv.with_cache(sh, |c| {
                c.pin(&pins)
                    .map_err(|r| (r, c.pin_count(0), c.pin_limits().0))
            });
            return match got {
                Ok(got) => Response::json(200, &got),
                Err((refusal, now, limits)) => Response::json(
                    409,
                    &serde_json::json!({
                        "error": refusal.to_string(),
                        "pins": now.pins,
                        "max_pins": limits.max_pins,
                        "pinned_bytes": now.bytes,
                        "max_pinned_bytes": limits.max_bytes,
                    }),
                ),
            };
        }
        if path == "/pins" {
            let (after, limit) = match parse_page(query) {
                Ok(p) => p,
                Err(e) => return Response::text(400, &format!("GET /pins: {e}\n{PINS_QUERY}\n")),
            };
            let (page, more, st, (limits, over_bound)) = sh.kv.with_cache(sh, |c| {
                let (page, more) = c.pins_page(after.as_ref(), limit);
                (page, more, c.pin_count(0), c.pin_limits())
            });
            let list: Vec<_> = page
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "model_id": format!("{:#018x}", p.model_id),
                        "salt": format!("{:#018x}", p.salt),
                        "hash": hex(&p.hash),
                    })
                })
                .collect();
            let next = more.then(|| page.last().map(cursor)).flatten();
            return Response::json(
                200,
                &serde_json::json!({
                    "pins": list,
                    "next": next,
                    "held": st.pins,
                    "max_pins": limits.max_pins,
                    "pinned_objects": st.objects,
                    "pinned_bytes": st.bytes,
                    "max_pinned_bytes": limits.max_bytes,
                    "stored_over_bound": over_bound,
                }),
            );
        }
        let (objects, bytes) = if path == "/clear" {
            sh.kv.with_cache(sh, |c| c.clear())
        } else {
            let n = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("bytes="))
                .and_then(|v| crate::units::parse_bytes(v).ok());
            let Some(n) = n else {
                return Response::text(
                    400,
                    "POST /evict?bytes=N (N: bytes, K/M/G/KiB/MiB/GiB suffixes)\n",
                );
            };
            sh.kv.with_cache(sh, |c| c.evict_bytes(n))
        };
        Response::json(
            200,
            &serde_json::json!({ "objects": objects, "bytes": bytes }),
        )
    }

    /// A reading compared with `first` when given (taken a sample apart),
    /// else with the previous one when that is recent (10 s): rings that
    /// did not move between them are flagged. Readings are taken one at a
    /// time, so each is compared with an earlier one.
    fn reading(&self, first: Option<&Snapshot>) -> Snapshot {
        let mut prev = lock(&self.prev);
        let mut s = inspect::snapshot(&self.seg, self.th);
        match (first, prev.as_ref()) {
            (Some(p), _) => inspect::compare(p, &mut s),
            (None, Some(p))
                if s.taken_mono_ns.saturating_sub(p.taken_mono_ns) < 10_000_000_000 =>
            {
                inspect::compare(p, &mut s)
            }
            _ => {}
        }
        // No answer uses the job rows (`/status` skips them, as `show
        // --json` does), and `compare` reads only the clients: the copy
        // kept for the next reading leaves them out.
        s.rows = Vec::new();
        *prev = Some(s.clone());
        s
    }
}

/// What the endpoint reads of a request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    /// The client accepts OpenMetrics (Prometheus asks for it).
    pub(crate) openmetrics: bool,
    /// The credentials of an `Authorization: Bearer` header.
    pub(crate) bearer: Option<Vec<u8>>,
    /// The body, when the request had a `Content-Length`.
    pub(crate) body: Option<Vec<u8>>,
}

/// What `POST /pin` and `POST /unpin` take (said with a refusal).
const PIN_BODY: &str = r#"expected a JSON body {"model_id": <u64: a number or a "0x..." hex string>, "salt": <the same; optional, 0>, "hashes": ["<a chunk hash: 32 hex digits>", ...]}"#;

/// Lowercase hex of `b`, in order.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A u64 of 1 to 16 hex digits (no prefix, no sign).
fn hex_u64(digits: &str) -> Option<u64> {
    let ok = (1..=16).contains(&digits.len()) && digits.bytes().all(|c| c.is_ascii_hexdigit());
    ok.then(|| u64::from_str_radix(digits, 16).ok()).flatten()
}

/// A chunk hash of exactly two hex digits per byte.
fn hex_hash(s: &str) -> Option<crate::kv::ChunkHash> {
    let mut h = crate::kv::ChunkHash::default();
    if s.len() != h.len() * 2 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    for (b, pair) in h.iter_mut().zip(s.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).expect("ASCII hex digits");
        *b = u8::from_str_radix(pair, 16).expect("checked hex digits");
    }
    Some(h)
}

/// A u64 given as a JSON number or a `"0x..."` hex string.
fn json_u64(v: &serde_json::Value, what: &str) -> Result<u64, String> {
    let bad = || {
        format!("{what}: expected a u64 (a number, or a \"0x...\" hex string of 1 to 16 digits), got {v}")
    };
    match v {
        serde_json::Value::Number(n) => n.as_u64().ok_or_else(bad),
        serde_json::Value::String(s) => s
            .strip_prefix("0x")
            .or_else(|| s.strip_prefix("0X"))
            .and_then(hex_u64)
            .ok_or_else(bad),
        _ => Err(bad()),
    }
}

/// A chunk hash: exactly two hex digits per byte of [`crate::kv::ChunkHash`].
fn json_hash(v: &serde_json::Value, i: usize) -> Result<crate::kv::ChunkHash, String> {
    let len = crate::kv::ChunkHash::default().len();
    let bad = |got: String| {
        format!(
            "hashes[{i}]: expected a chunk hash of exactly {} hex digits ({len} bytes), got {got}",
            len * 2
        )
    };
    let Some(s) = v.as_str() else {
        return Err(bad(v.to_string()));
    };
    hex_hash(s).ok_or_else(|| bad(format!("{} characters", s.chars().count())))
}

/// What `GET /pins` takes.
const PINS_QUERY: &str = "expected GET /pins[?limit=N][&after=CURSOR] (N: 1 to 1000, default 1000; CURSOR: the \"next\" of the page before)";

/// A pin as a listing's cursor: model, salt and hash in hex, dot-separated.
fn cursor(p: &Pin) -> String {
    format!("{:016x}.{:016x}.{}", p.model_id, p.salt, hex(&p.hash))
}

/// The pin a cursor names.
fn parse_cursor(c: &str) -> Option<Pin> {
    let mut parts = c.split('.');
    let (m, s, h) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || m.len() != 16 || s.len() != 16 {
        return None;
    }
    Some(Pin {
        model_id: hex_u64(m)?,
        salt: hex_u64(s)?,
        hash: hex_hash(h)?,
    })
}

/// The page a `GET /pins` query asks for: after which pin, and how many.
fn parse_page(query: &str) -> Result<(Option<Pin>, usize), String> {
    let (mut after, mut limit) = (None, MAX_PINS_PER_PAGE);
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "after" => {
                after = Some(parse_cursor(v).ok_or_else(|| format!("after={v:?}: not a cursor"))?)
            }
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PINS_PER_PAGE).contains(n))
                    .ok_or_else(|| format!("limit={v:?}: 1 to {MAX_PINS_PER_PAGE}"))?
            }
            _ => return Err(format!("unknown parameter {k:?}")),
        }
    }
    Ok((after, limit))
}

/// The pins a `/pin` or `/unpin` body names, or the status and reason of
/// a refusal (400; 413 past [`MAX_PINS_PER_CALL`] hashes).
fn parse_pins(body: Option<&[u8]>) -> Result<Vec<Pin>, (u16, String)> {
    let bad = |e: String| (400, e);
    let Some(body) = body else {
        return Err(bad("no body (send it with a Content-Length)".into()));
    };
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let serde_json::Value::Object(o) = &v else {
        return Err(bad("the body is not a JSON object".into()));
    };
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "model_id" | "salt" | "hashes"))
    {
        return Err(bad(format!("unknown field {k:?}")));
    }
    let missing = |what: &str| bad(format!("{what} is missing"));
    let model_id =
        json_u64(o.get("model_id").ok_or_else(|| missing("model_id"))?, "model_id").map_err(bad)?;
    let salt = o
        .get("salt")
        .map_or(Ok(0), |s| json_u64(s, "salt"))
        .map_err(bad)?;
    let hashes = o
        .get("hashes")
        .ok_or_else(|| missing("hashes"))?
        .as_array()
        .ok_or_else(|| bad("hashes: expected an array of chunk hashes".into()))?;
    if hashes.is_empty() {
        return Err(bad("hashes: expected at least one chunk hash".into()));
    }
    if hashes.len() > MAX_PINS_PER_CALL {
        return Err((
            413,
            format!(
                "{} chunk hashes: at most {MAX_PINS_PER_CALL} per call (send more calls)",
                hashes.len()
            ),
        ));
    }
    hashes
        .iter()
        .enumerate()
        .map(|(i, h)| {
            Ok(Pin {
                model_id,
                salt,
                hash: json_hash(h, i).map_err(bad)?,
            })
        })
        .collect()
}

/// What a [`RequestReader`] says after the bytes it was given.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Step {
    /// More bytes are needed (at most [`RequestReader::room`]).
    More,
    /// The headers are in, and the client waits for `100 Continue` before
    /// it sends its body (curl does for bodies over 1 KiB): send it, then
    /// read on. Said once at most.
    SendContinue,
    /// The request, or the answer that refuses it.
    Done(Result<Request, Response>),
}

/// Reads a request from the bytes of a connection as they arrive, in any
/// split: headers, then a body of `Content-Length` bytes, all of it within
/// [`REQUEST_LIMIT`]. It does no I/O (the connection's task does), so what
/// it answers depends on the bytes only, never on how they were split: the
/// headers are parsed from the bytes received so far (never past the
/// limit) until they are whole, then kept.
#[derive(Default)]
pub(crate) struct RequestReader {
    buf: Vec<u8>,
    head: Option<Head>,
    continued: bool,
}

/// A request's head, once its headers are whole.
struct Head {
    /// The request, without its body.
    request: Request,
    /// The head's length: where the body starts.
    len: usize,
    /// The body's length, when it has one (`Content-Length`).
    body_len: Option<usize>,
    /// The client waits for `100 Continue` before its body.
    expect_continue: bool,
}

impl RequestReader {
    /// How many more bytes this reader takes: one past the limit at most,
    /// which it refuses.
    pub(crate) fn room(&self) -> usize {
        (REQUEST_LIMIT + 1).saturating_sub(self.buf.len())
    }

    /// The bytes the request takes (head and body), once its head is read.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn request_len(&self) -> Option<usize> {
        self.head
            .as_ref()
            .map(|h| h.len + h.body_len.unwrap_or(0))
    }

    /// Takes the next bytes read (at most [`Self::room`]: the rest is not
    /// looked at); none: the client closed its side.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Step {
        if bytes.is_empty() {
            return Step::Done(Err(Response::text(
                400,
                "connection closed mid-request\n",
            )));
        }
        let take = bytes.len().min(self.room());
        self.buf.extend_from_slice(&bytes[..take]);
        if self.head.is_none() {
            match parse_head(&self.buf) {
                Ok(Some(h)) => self.head = Some(h),
                Ok(None) => return Step::More,
                Err(r) => return Step::Done(Err(r)),
            }
        }
        let h = self.head.as_ref().expect("the head was read");
        let Some(body_len) = h.body_len else {
            return Step::Done(Ok(h.request.clone()));
        };
        // (`parse_head` checked that it fits the limit.)
        let end = h.len + body_len;
        if self.buf.len() >= end {
            let mut request = h.request.clone();
            request.body = Some(self.buf[h.len..end].to_vec());
            return Step::Done(Ok(request));
        }
        if h.expect_continue && !self.continued {
            self.continued = true;
            return Step::SendContinue;
        }
        Step::More
    }
}

/// The answer to a request larger than the bound.
fn too_large() -> Response {
    Response::text(
        413,
        &format!("request too large: at most {REQUEST_LIMIT} bytes, headers and body\n"),
    )
}

/// The head of the request whose first bytes are `buf`: none while its
/// headers are not whole, or the answer that refuses it.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, Response> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(&buf[..buf.len().min(REQUEST_LIMIT)]) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > REQUEST_LIMIT => return Err(too_large()),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(Response::text(400, &format!("malformed request: {e}\n"))),
    };
    let header = |name: &'static str| {
        req.headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
    };
    let openmetrics = header("accept")
        .any(|h| String::from_utf8_lossy(h.value).contains("application/openmetrics-text"));
    if header("transfer-encoding").next().is_some() {
        return Err(Response::text(
            400,
            "a body is taken with a Content-Length only (no Transfer-Encoding)\n",
        ));
    }
    let mut body_len: Option<usize> = None;
    for h in header("content-length") {
        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
        let n = (!v.is_empty() && v.bytes().all(|c| c.is_ascii_digit()))
            .then(|| v.parse::<usize>().ok())
            .flatten();
        match (n, body_len) {
            (None, _) => return Err(Response::text(400, "malformed Content-Length\n")),
            (Some(n), Some(m)) if n != m => {
                return Err(Response::text(400, "conflicting Content-Length headers\n"))
            }
            (n, _) => body_len = n,
        }
    }
    if let Some(n) = body_len {
        if len.checked_add(n).is_none_or(|end| end > REQUEST_LIMIT) {
            return Err(too_large());
        }
    }
    let mut auth = header("authorization");
    let bearer = match (auth.next(), auth.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => {
            return Err(Response::text(400, "more than one Authorization header\n"))
        }
        (Some(h), None) => bearer_credentials(h.value).map(<[u8]>::to_vec),
    };
    let expect_continue = header("expect").any(|h| h.value.eq_ignore_ascii_case(b"100-continue"));
    Ok(Some(Head {
        request: Request {
            method: req.method.unwrap_or("").to_string(),
            path: req.path.unwrap_or("").to_string(),
            openmetrics,
            bearer,
            body: None,
        },
        len,
        body_len,
        expect_continue,
    }))
}

/// The credentials of an `Authorization` value of the `Bearer` scheme (in
/// any case), if it is one.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let at = value.iter().position(|c| c.is_ascii_whitespace())?;
    let (scheme, rest) = value.split_at(at);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii())
}

/// The admin token: 64 hex digits of 32 bytes from the OS's random
/// source, in a file only the server's user can read.
struct AdminToken {
    hex: Vec<u8>,
    path: PathBuf,
}

impl AdminToken {
    /// Draws a token and writes it to `path` (mode 0600), replacing the
    /// file of a server that did not stop cleanly.
    fn create(path: &Path) -> crate::Result<AdminToken> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let mut raw = [0u8; 32];
        os_random(&mut raw).map_err(crate::error::io("draw the admin token"))?;
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let at = || format!("write the admin token {}", path.display());
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(crate::error::io(at())(e)),
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(crate::error::io(at()))?;
        // The umask may have taken bits away, never added any: exactly
        // 0600, so the server's user can read it back.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .and_then(|()| f.write_all(hex.as_bytes()))
            .map_err(crate::error::io(at()))?;
        Ok(AdminToken {
            hex: hex.into_bytes(),
            path: path.to_path_buf(),
        })
    }

    /// Whether `given` is the token. The time taken does not depend on
    /// where they differ (only on whether the lengths do).
    fn admits(&self, given: Option<&[u8]>) -> bool {
        let Some(given) = given else {
            return false;
        };
        if given.len() != self.hex.len() {
            return false;
        }
        let diff = given
            .iter()
            .zip(&self.hex)
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// The answer to an admin call without the token.
    fn refusal(&self) -> Response {
        Response::text(
            401,
            &format!(
                "admin calls need the server's admin token: send \"Authorization: Bearer <token>\", \
                 the token being the contents of {} (readable by the server's user only)\n",
                self.path.display()
            ),
        )
    }
}

/// Fills `buf` from the OS's random source.
fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: getrandom writes at most `rest.len()` bytes to
        // `rest.as_mut_ptr()`, which points to that many writable bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

/// The open connections: their number, and the ones waiting on their
/// client (reading the request, writing the answer), oldest first, which
/// may be closed to make room.
struct Slots {
    max: usize,
    open: usize,
    next: u64,
    waiting: BTreeMap<u64, Arc<Notify>>,
}

/// One open connection's place.
struct Slot {
    id: u64,
    slots: Arc<Mutex<Slots>>,
    closed: Arc<Notify>,
    /// In `waiting`, or closed to make room (and counted out then); false
    /// while it is being answered.
    waiting: bool,
}

impl Slots {
    /// Closes the oldest connection waiting on its client (its task
    /// answers 503 and ends when it runs next); false if none is.
    fn close_oldest(&mut self) -> bool {
        match self.waiting.pop_first() {
            Some((_, closed)) => {
                // Stores a permit when the task is not waiting on it: it
                // sees it at its next wait.
                closed.notify_one();
                self.open -= 1;
                true
            }
            None => false,
        }
    }

    /// A place for a new connection (waiting on its client), making room
    /// if the bound is reached; none when every connection is being
    /// answered.
    fn admit(slots: &Arc<Mutex<Slots>>) -> Option<Slot> {
        let mut s = lock(slots);
        if s.open >= s.max && !s.close_oldest() {
            return None;
        }
        s.open += 1;
        let id = s.next;
        s.next += 1;
        let closed = Arc::new(Notify::new());
        s.waiting.insert(id, closed.clone());
        Some(Slot {
            id,
            slots: slots.clone(),
            closed,
            waiting: true,
        })
    }
}

impl Slot {
    /// Being answered: not closed to make room meanwhile. False if it was
    /// closed already (and counted out then).
    fn hold(&mut self) -> bool {
        let held = lock(&self.slots).waiting.remove(&self.id).is_some();
        if held {
            self.waiting = false;
        }
        held
    }

    /// Waiting on the client again (its answer being written).
    fn release(&mut self) {
        lock(&self.slots)
            .waiting
            .insert(self.id, self.closed.clone());
        self.waiting = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = lock(&self.slots);
        // A connection closed to make room was counted out then.
        if !self.waiting || s.waiting.remove(&self.id).is_some() {
            s.open -= 1;
        }
    }
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
    let slots = Arc::new(Mutex::new(Slots {
        max,
        open: 0,
        next: 0,
        waiting: BTreeMap::new(),
    }));
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
        () = slot.closed.notified() => {
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
        () = slot.closed.notified() => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(max: usize) -> Arc<Mutex<Slots>> {
        Arc::new(Mutex::new(Slots {
            max,
            open: 0,
            next: 0,
            waiting: BTreeMap::new(),
        }))
    }

    #[test]
    fn a_full_endpoint_closes_its_oldest_waiting_connection_and_counts_each_once() {
        let s = slots(2);
        let open = || lock(&s).open;
        let mut a = Slots::admit(&s).unwrap();
        let mut b = Slots::admit(&s).unwrap();
        // Both being answered: no room.
        assert!(a.hold() && b.hold());
        assert!(Slots::admit(&s).is_none());
        // `a` writes its answer: it is the one closed for the next.
        a.release();
        let mut c = Slots::admit(&s).unwrap();
        assert_eq!(open(), 2);
        // Its end counts nothing again; `b`'s does.
        drop(a);
        assert_eq!(open(), 2);
        drop(b);
        assert_eq!(open(), 1);
        // `c`, still reading its request, is the oldest waiting: closed for
        // `e`, it cannot be held for an answer, and its end counts nothing.
        let mut d = Slots::admit(&s).unwrap();
        let e = Slots::admit(&s).unwrap();
        assert!(!c.hold());
        drop(c);
        assert_eq!(open(), 2);
        assert!(d.hold());
        drop(d);
        drop(e);
        assert_eq!(open(), 0);
        assert!(lock(&s).waiting.is_empty());
    }

    #[test]
    fn bearer_credentials_are_the_bearer_schemes_only() {
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"  bEaReR \t abc  "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Bearer"), None);
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        assert_eq!(bearer_credentials(b"abc"), None);
    }

    #[test]
    fn the_token_is_admitted_whole_only() {
        let dir = std::env::temp_dir().join(format!("kvring-token-{}", std::process::id()));
        crate::rundir::ensure_runtime_dir(&dir).unwrap();
        let path = dir.join("t.admin-token");
        std::fs::write(&path, "stale").unwrap();
        let t = AdminToken::create(&path).unwrap();
        let text = std::fs::read(&path).unwrap();
        assert_eq!(text, t.hex);
        assert_eq!(text.len(), 64);
        assert!(t.admits(Some(&text)));
        assert!(!t.admits(None));
        assert!(!t.admits(Some(&text[..63])));
        let mut other = text.clone();
        other[0] ^= 1;
        assert!(!t.admits(Some(&other)));
        // Another token each time.
        let again = AdminToken::create(&path).unwrap();
        assert_ne!(again.hex, t.hex);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
