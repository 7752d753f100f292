//! The server's HTTP endpoint (`kvring serve --http ADDR`): Prometheus
//! metrics, a liveness probe that sees a stall, a readiness probe and the
//! inspector's JSON, served by one thread (`kvring-http`) from the segment
//! as the inspector reads it: its own read-only mapping, the same snapshot
//! and anomaly checks ([`crate::inspect`]), and no lock the ring loop, the
//! acceptor or a copy worker takes.
//!
//! One request per connection (`Connection: close`), read within
//! [`CLIENT_DEADLINE`] and at most [`REQUEST_LIMIT`] bytes: a malformed
//! request is answered 400, a slow or silent client is dropped at the
//! deadline. Connections are served one after another, so a client can
//! delay the next scrape by the deadline at most, never the server's
//! other threads.
//!
//! * `GET /metrics`: the metrics of a reading ([`crate::inspect::openmetrics`]
//!   when the client accepts OpenMetrics, as Prometheus does, else
//!   Prometheus's text format 0.0.4).
//! * `GET /healthz`: two readings 100 ms apart; 200 and `{"status":"ok"}`
//!   unless the reading shows a stall (503, `{"status":"unhealthy",
//!   "reasons": [...]}`): the heartbeat stopped (the acceptor keeps it), a
//!   request ring with bytes waiting whose head did not move (the ring
//!   loop), a copy worker with work that made no step for longer than the
//!   stalled-lane bound (a wedged copy, a stopped thread), a job unfinished
//!   for longer than the stuck-job bound (an engine event that never
//!   completes), or words that contradict each other.
//! * `GET /readyz`: 200 while the server is `running` (accepting clients)
//!   and its whole pool is ready for copies (pinned, with the CUDA
//!   backend, which pins it 1 GiB at a time after the start), else 503.
//! * `GET /status`: the inspector's `show --json` object.
//! * Admin, from loopback peers only unless `admin_remote`: `POST /clear`
//!   (drops every object no lease holds and no pin covers, as CLEAR) and
//!   `POST /evict?bytes=N` (evicts at least N bytes of such objects, least
//!   recently used first), both answering `{"objects": n, "bytes": b}` of
//!   what went; `POST /pin` and `POST /unpin` with a JSON body
//!   `{"model_id": M, "salt": S, "hashes": ["<32 hex digits>", ...]}` (M
//!   and S: a number or a `"0x..."` hex string; S optional, 0) add or
//!   remove the pins of those chunks ([`super::cache::Pin`]: their objects
//!   of any fingerprint and rank, stored now or later, are neither evicted
//!   nor cleared), answering `{"pins", "objects", "bytes", "matched"}`
//!   ([`super::cache::PinCount`]); `GET /pins` lists the pins. These take
//!   the cache's lock for their work, as a client's CLEAR does.

use super::cache::Pin;
use crate::inspect::{self, AnomalyKind, Snapshot, Thresholds};
use crate::segment::ReadOnlySegment;
use crate::shm::ServerState;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a client has to send its request (and to take the answer).
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// The largest request read (method, path, headers and body).
pub const REQUEST_LIMIT: usize = 16 * 1024;
/// The default address: loopback, Prometheus's conventional exporter port.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9090";
/// Two readings this far apart show a ring that stopped moving.
const STALL_SAMPLE: Duration = Duration::from_millis(100);

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
    /// Accept the admin calls from peers other than loopback.
    pub admin_remote: bool,
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
        }
    }
}

/// The running endpoint: stopped and joined on drop.
pub(crate) struct HttpServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl HttpServer {
    /// Binds `cfg.addr` (before the server's threads start, so a required
    /// address that is taken fails the start cleanly).
    pub fn bind(cfg: &HttpConfig) -> std::io::Result<TcpListener> {
        let l = TcpListener::bind(cfg.addr)?;
        l.set_nonblocking(true)?;
        Ok(l)
    }

    /// Serves on `listener` from the segment `shm_name`; admin calls act
    /// on `shared`'s cache.
    pub fn start(
        listener: TcpListener,
        shm_name: &str,
        cfg: &HttpConfig,
        shared: Arc<super::Shared>,
    ) -> crate::Result<HttpServer> {
        let seg = ReadOnlySegment::open_shm(shm_name)?;
        let addr = listener
            .local_addr()
            .map_err(crate::error::io("the HTTP endpoint's address"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let th = Thresholds {
            job_age_s: cfg.stuck_job.as_secs_f64(),
            lane_stall_s: cfg.stalled_lane.as_secs_f64(),
        };
        let s = stop.clone();
        let admin_remote = cfg.admin_remote;
        let thread = std::thread::Builder::new()
            .name("kvring-http".into())
            .spawn(move || {
                Endpoint {
                    seg,
                    th,
                    prev: None,
                    shared,
                    admin_remote,
                }
                .run(&listener, &s)
            })
            .map_err(crate::error::io("spawn the HTTP thread"))?;
        Ok(HttpServer {
            stop,
            thread: Some(thread),
            addr,
        })
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        // Release pairs with the loop's Acquire load.
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A response: status, content type, body.
struct Response(u16, &'static str, Vec<u8>);

impl Response {
    fn text(code: u16, body: &str) -> Response {
        Response(code, "text/plain; charset=utf-8", body.as_bytes().to_vec())
    }

    fn json(code: u16, v: &impl serde::Serialize) -> Response {
        let body = serde_json::to_vec(v).expect("serializable");
        Response(code, "application/json", body)
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

struct Endpoint {
    seg: ReadOnlySegment,
    th: Thresholds,
    /// The last reading, to compare the next one with (rings that did not
    /// move between them).
    prev: Option<Snapshot>,
    /// The server's state, for the admin calls only.
    shared: Arc<super::Shared>,
    admin_remote: bool,
}

impl Endpoint {
    fn run(mut self, listener: &TcpListener, stop: &AtomicBool) {
        // Acquire pairs with `HttpServer::drop`'s Release store.
        while !stop.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((stream, _)) => self.serve(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Sleep until a connection arrives, 100 ms at most (the
                    // stop flag is checked that often).
                    let mut fds = [nix::poll::PollFd::new(
                        listener.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u8));
                }
                Err(e) => {
                    tracing::warn!("HTTP accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Reads one request within the deadline, answers it, closes.
    fn serve(&mut self, mut stream: TcpStream) {
        let deadline = Instant::now() + CLIENT_DEADLINE;
        let loopback = stream.peer_addr().is_ok_and(|a| a.ip().is_loopback());
        let resp = match read_request(&mut stream, deadline) {
            Ok(req) => self.route(&req, loopback),
            Err(r) => r,
        };
        let _ = stream.set_write_timeout(Some(CLIENT_DEADLINE));
        let head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n",
            resp.0,
            reason(resp.0),
            resp.1,
            resp.2.len()
        );
        let _ = stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(&resp.2));
        // Closing with unread bytes would reset the connection before the
        // client read the answer: read what is left (briefly, boundedly).
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
        let mut sink = [0u8; 4096];
        let mut left: usize = 64 * 1024;
        while left > 0 {
            match stream.read(&mut sink) {
                Ok(n) if n > 0 => left = left.saturating_sub(n),
                _ => break,
            }
        }
    }

    fn route(&mut self, req: &Request, loopback: bool) -> Response {
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
            return self.admin(path, query, req.body.as_deref());
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
                let s = self.reading();
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
            "/status" => Response::json(200, &self.reading()),
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
                // `/healthz`: two readings apart, always.
                let first = inspect::snapshot(&self.seg, self.th);
                std::thread::sleep(STALL_SAMPLE);
                self.prev = Some(first);
                let s = self.reading();
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
                Err(e) => return Response::text(400, &format!("POST {path}: {e}\n{PIN_BODY}\n")),
            };
            let got = sh.kv.with_cache(sh, |c| {
                if path == "/pin" {
                    c.pin(&pins)
                } else {
                    c.unpin(&pins)
                }
            });
            return Response::json(200, &got);
        }
        if path == "/pins" {
            let pins = sh.kv.with_cache(sh, |c| c.pins());
            let list: Vec<_> = pins
                .iter()
                .map(|p| {
                    serde_json::json!({
                        "model_id": format!("{:#018x}", p.model_id),
                        "salt": format!("{:#018x}", p.salt),
                        "hash": hex(&p.hash),
                    })
                })
                .collect();
            return Response::json(200, &serde_json::json!({ "pins": list }));
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

    /// A reading, compared with the previous one when that is recent (10 s):
    /// rings that did not move between them are flagged.
    fn reading(&mut self) -> Snapshot {
        let mut s = inspect::snapshot(&self.seg, self.th);
        if let Some(p) = &self.prev {
            if s.taken_mono_ns.saturating_sub(p.taken_mono_ns) < 10_000_000_000 {
                inspect::compare(p, &mut s);
            }
        }
        // No answer uses the job rows (`/status` skips them, as `show
        // --json` does), and `compare` reads only the clients: the copy
        // kept for the next reading leaves them out.
        s.rows = Vec::new();
        self.prev = Some(s.clone());
        s
    }
}

/// What the endpoint reads of a request.
struct Request {
    method: String,
    path: String,
    /// The client accepts OpenMetrics (Prometheus asks for it).
    openmetrics: bool,
    /// The body, when the request had a `Content-Length`.
    body: Option<Vec<u8>>,
}

/// What `POST /pin` and `POST /unpin` take (said with a refusal).
const PIN_BODY: &str = r#"expected a JSON body {"model_id": <u64: a number or a "0x..." hex string>, "salt": <the same; optional, 0>, "hashes": ["<a chunk hash: 32 hex digits>", ...]}"#;

/// Lowercase hex of `b`, in order.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A u64 given as a JSON number or a `"0x..."` hex string.
fn json_u64(v: &serde_json::Value, what: &str) -> Result<u64, String> {
    let bad = || {
        format!("{what}: expected a u64 (a number, or a \"0x...\" hex string of 1 to 16 digits), got {v}")
    };
    match v {
        serde_json::Value::Number(n) => n.as_u64().ok_or_else(bad),
        serde_json::Value::String(s) => {
            let digits = s
                .strip_prefix("0x")
                .or_else(|| s.strip_prefix("0X"))
                .ok_or_else(bad)?;
            if digits.is_empty()
                || digits.len() > 16
                || !digits.bytes().all(|c| c.is_ascii_hexdigit())
            {
                return Err(bad());
            }
            u64::from_str_radix(digits, 16).map_err(|_| bad())
        }
        _ => Err(bad()),
    }
}

/// A chunk hash: exactly two hex digits per byte of [`crate::kv::ChunkHash`].
fn json_hash(v: &serde_json::Value, i: usize) -> Result<crate::kv::ChunkHash, String> {
    let mut h = crate::kv::ChunkHash::default();
    let digits = h.len() * 2;
    let bad = |got: String| {
        format!(
            "hashes[{i}]: expected a chunk hash of exactly {digits} hex digits ({} bytes), got {got}",
            h.len()
        )
    };
    let Some(s) = v.as_str() else {
        return Err(bad(v.to_string()));
    };
    if s.len() != digits || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad(format!("{} characters", s.chars().count())));
    }
    for (b, pair) in h.iter_mut().zip(s.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).expect("ASCII hex digits");
        *b = u8::from_str_radix(pair, 16).expect("checked hex digits");
    }
    Ok(h)
}

/// The pins a `/pin` or `/unpin` body names.
fn parse_pins(body: Option<&[u8]>) -> Result<Vec<Pin>, String> {
    let Some(body) = body else {
        return Err("no body (send it with a Content-Length)".into());
    };
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let serde_json::Value::Object(o) = &v else {
        return Err("the body is not a JSON object".into());
    };
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "model_id" | "salt" | "hashes"))
    {
        return Err(format!("unknown field {k:?}"));
    }
    let model_id = json_u64(o.get("model_id").ok_or("model_id is missing")?, "model_id")?;
    let salt = o.get("salt").map_or(Ok(0), |s| json_u64(s, "salt"))?;
    let hashes = o
        .get("hashes")
        .ok_or("hashes is missing")?
        .as_array()
        .ok_or("hashes: expected an array of chunk hashes")?;
    if hashes.is_empty() {
        return Err("hashes: expected at least one chunk hash".into());
    }
    hashes
        .iter()
        .enumerate()
        .map(|(i, h)| {
            Ok(Pin {
                model_id,
                salt,
                hash: json_hash(h, i)?,
            })
        })
        .collect()
}

/// Reads more of the request into `buf` before `deadline`.
fn read_more(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    deadline: Instant,
) -> std::result::Result<(), Response> {
    let mut chunk = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Response::text(408, "request not received in time\n"));
        }
        let _ = stream.set_read_timeout(Some(left));
        match stream.read(&mut chunk) {
            Ok(0) => return Err(Response::text(400, "connection closed mid-request\n")),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(());
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(Response::text(408, "request not received in time\n"))
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return Err(Response::text(400, "unreadable request\n")),
        }
    }
}

/// The request, or the response that refuses it: headers, then a body of
/// `Content-Length` bytes (all of it within [`REQUEST_LIMIT`] and the
/// deadline).
fn read_request(
    stream: &mut TcpStream,
    deadline: Instant,
) -> std::result::Result<Request, Response> {
    let _ = stream.set_nonblocking(false);
    let too_large = || {
        Response::text(
            413,
            &format!("request too large: at most {REQUEST_LIMIT} bytes, headers and body\n"),
        )
    };
    let mut buf = Vec::with_capacity(1024);
    let (mut request, head, body_len, expect_continue) = loop {
        read_more(stream, &mut buf, deadline)?;
        if buf.len() > REQUEST_LIMIT {
            return Err(too_large());
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(head)) => {
                let header = |name: &'static str| {
                    req.headers
                        .iter()
                        .filter(move |h| h.name.eq_ignore_ascii_case(name))
                };
                let openmetrics = header("accept").any(|h| {
                    String::from_utf8_lossy(h.value).contains("application/openmetrics-text")
                });
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
                let expect_continue =
                    header("expect").any(|h| h.value.eq_ignore_ascii_case(b"100-continue"));
                let request = Request {
                    method: req.method.unwrap_or("").to_string(),
                    path: req.path.unwrap_or("").to_string(),
                    openmetrics,
                    body: None,
                };
                break (request, head, body_len, expect_continue);
            }
            Ok(httparse::Status::Partial) => continue,
            Err(e) => return Err(Response::text(400, &format!("malformed request: {e}\n"))),
        }
    };
    let Some(len) = body_len else {
        return Ok(request);
    };
    let end = head
        .checked_add(len)
        .filter(|&e| e <= REQUEST_LIMIT)
        .ok_or_else(too_large)?;
    if buf.len() < end && expect_continue {
        // The client waits for this before sending the body (curl does,
        // for bodies over 1 KiB).
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = stream.set_write_timeout(Some(left.max(Duration::from_millis(1))));
        let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
    }
    while buf.len() < end {
        read_more(stream, &mut buf, deadline)?;
    }
    request.body = Some(buf[head..end].to_vec());
    Ok(request)
}
