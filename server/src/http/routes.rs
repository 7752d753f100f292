//! The endpoint's routes, in one table: each path with its method, who may
//! call it and what it does. The probes and the inspector's reads answer
//! from the segment on the connection's task; the admin calls run one at a
//! time on the admin thread, bounded by [`ADMIN_DEADLINE`].

use super::pins::{self, PinRefused, PinsPage, PINS_QUERY, PIN_BODY};
use super::{lock, AdminToken, Request, Response};
use kvring::inspect::{self, AnomalyKind, Snapshot, Thresholds};
use kvring::segment::ReadOnlySegment;
use kvring::shm::ServerState;
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Two readings this far apart show a ring that stopped moving.
const STALL_SAMPLE: Duration = Duration::from_millis(100);
/// How long an admin call may wait for its turn and do its work before
/// its client is answered 503 (the call itself then still finishes).
const ADMIN_DEADLINE: Duration = Duration::from_secs(30);
/// A reading is compared with the one before it when that is this recent.
const COMPARE_WITHIN_NS: u64 = 10_000_000_000;

/// What a route does. Who may call it follows from which kind it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// Whoever can connect.
    Read(Read),
    /// From loopback (or any peer with `admin_remote`), with the admin
    /// token; run on the admin thread.
    Admin(Admin),
}

/// The read-only routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    Metrics,
    Healthz,
    Readyz,
    Status,
}

/// The admin routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admin {
    Pins,
    Clear,
    Evict,
    Pin,
    Unpin,
}

/// One route.
struct Route {
    method: &'static str,
    path: &'static str,
    /// The query it takes, as the 404 answer lists it.
    query: &'static str,
    call: Call,
}

const fn route(method: &'static str, path: &'static str, call: Call) -> Route {
    Route {
        method,
        path,
        query: "",
        call,
    }
}

/// Every route the endpoint serves (the module documentation of
/// [`super`] says what each answers).
const ROUTES: &[Route] = &[
    route("GET", "/metrics", Call::Read(Read::Metrics)),
    route("GET", "/healthz", Call::Read(Read::Healthz)),
    route("GET", "/readyz", Call::Read(Read::Readyz)),
    route("GET", "/status", Call::Read(Read::Status)),
    route("GET", "/pins", Call::Admin(Admin::Pins)),
    route("POST", "/clear", Call::Admin(Admin::Clear)),
    Route {
        query: "?bytes=N",
        ..route("POST", "/evict", Call::Admin(Admin::Evict))
    },
    route("POST", "/pin", Call::Admin(Admin::Pin)),
    route("POST", "/unpin", Call::Admin(Admin::Unpin)),
];

/// The answer to a path no route has: every route.
fn not_found() -> Response {
    let list: Vec<_> = ROUTES
        .iter()
        .map(|r| format!("{} {}{}", r.method, r.path, r.query))
        .collect();
    Response::text(404, &format!("not found: {}\n", list.join(", ")))
}

/// What the routes read and act on.
pub(super) struct Endpoint {
    pub(super) seg: ReadOnlySegment,
    pub(super) th: Thresholds,
    /// The last reading, to compare the next one with (rings that did not
    /// move between them).
    pub(super) prev: Mutex<Option<Snapshot>>,
    /// The cache service, for the admin calls only.
    pub(super) kv: Arc<crate::kv_ops::KvState>,
    pub(super) admin_remote: bool,
    pub(super) token: AdminToken,
}

/// What `POST /clear` and `POST /evict` answer: what went.
#[derive(Serialize)]
struct Dropped {
    objects: u64,
    bytes: u64,
}

/// What `GET /readyz` answers.
#[derive(Serialize)]
struct Readiness {
    ready: bool,
    state: inspect::Field<ServerState>,
    pool_bytes: u64,
    pool_ready_bytes: u64,
}

/// What `GET /healthz` answers.
#[derive(Serialize)]
struct Health<'a> {
    status: &'static str,
    reasons: Vec<&'a inspect::Anomaly>,
    heartbeat_age_ms: Option<f64>,
    stuck_job_s: f64,
    stalled_lane_s: f64,
}

impl Endpoint {
    /// The answer to `req` from a peer (`loopback` or not).
    pub(super) async fn route(self: Arc<Self>, req: Request, loopback: bool) -> Response {
        let (path, query) = req.path.split_once('?').unwrap_or((&req.path, ""));
        let Some(route) = ROUTES.iter().find(|r| r.path == path) else {
            return not_found();
        };
        if req.method != route.method {
            return Response::text(405, &format!("only {}\n", route.method));
        }
        match route.call {
            Call::Read(call) => self.read(call, req.openmetrics).await,
            Call::Admin(call) => {
                if !loopback && !self.admin_remote {
                    return Response::text(403, "admin calls are taken from loopback only\n");
                }
                if !self.token.admits(req.bearer.as_deref()) {
                    return self.token.refusal();
                }
                let (query, body) = (query.to_string(), req.body);
                let ep = self.clone();
                let work =
                    tokio::task::spawn_blocking(move || ep.admin(call, &query, body.as_deref()));
                match tokio::time::timeout(ADMIN_DEADLINE, work).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => Response::text(500, &format!("the admin call failed: {e}\n")),
                    Err(_) => Response::text(
                        503,
                        &format!(
                            "the admin call did not finish within {} s (it still may)\n",
                            ADMIN_DEADLINE.as_secs()
                        ),
                    ),
                }
            }
        }
    }

    /// The read-only routes: the metrics, the probes, the status.
    async fn read(&self, call: Read, openmetrics: bool) -> Response {
        match call {
            Read::Metrics => {
                let s = self.reading(None);
                if openmetrics {
                    Response::new(
                        200,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        crate::metrics::openmetrics(&s).into_bytes(),
                    )
                } else {
                    Response::new(
                        200,
                        "text/plain; version=0.0.4; charset=utf-8",
                        crate::metrics::prometheus_text(&s).into_bytes(),
                    )
                }
            }
            Read::Status => Response::json(200, &self.reading(None)),
            Read::Readyz => {
                let s = inspect::snapshot(&self.seg, self.th);
                let running =
                    s.server.alive && s.server.state.known() == Some(ServerState::Running);
                let ready = running && s.server.pool_ready_bytes >= s.cache.pool_bytes;
                Response::json(
                    if ready { 200 } else { 503 },
                    &Readiness {
                        ready,
                        state: s.server.state,
                        pool_bytes: s.cache.pool_bytes,
                        pool_ready_bytes: s.server.pool_ready_bytes,
                    },
                )
            }
            Read::Healthz => {
                // Two readings apart, always; the other connections are
                // served while this one waits.
                let first = inspect::snapshot(&self.seg, self.th);
                tokio::time::sleep(STALL_SAMPLE).await;
                let s = self.reading(Some(&first));
                let reasons: Vec<_> = s.anomalies.iter().filter(|a| unhealthy(a.kind)).collect();
                let ok = reasons.is_empty();
                // A tier down leaves the server serving from its pool:
                // degraded (200), not unhealthy.
                let degraded: Vec<_> = s
                    .anomalies
                    .iter()
                    .filter(|a| a.kind == inspect::AnomalyKind::TierDown)
                    .collect();
                let status = match (ok, degraded.is_empty()) {
                    (false, _) => "unhealthy",
                    (true, false) => "degraded",
                    (true, true) => "ok",
                };
                Response::json(
                    if ok { 200 } else { 503 },
                    &Health {
                        status,
                        reasons: if ok { degraded } else { reasons },
                        heartbeat_age_ms: s.server.heartbeat_age_ms,
                        stuck_job_s: self.th.job_age_s,
                        stalled_lane_s: self.th.lane_stall_s,
                    },
                )
            }
        }
    }

    /// The admin routes, on the admin thread: they take the cache's lock.
    fn admin(&self, call: Admin, query: &str, body: Option<&[u8]>) -> Response {
        let kv = &self.kv;
        match call {
            Admin::Pin | Admin::Unpin => {
                let path = if call == Admin::Pin { "/pin" } else { "/unpin" };
                let pins = match pins::parse_pins(body) {
                    Ok(p) => p,
                    Err((code, e)) => {
                        return Response::text(code, &format!("POST {path}: {e}\n{PIN_BODY}\n"))
                    }
                };
                if call == Admin::Unpin {
                    return Response::json(200, &kv.with_cache(|c| c.unpin(&pins)));
                }
                let got = kv.with_cache(|c| {
                    c.pin(&pins).map_err(|r| {
                        PinRefused::new(r.to_string(), &c.pin_count(0), &c.pin_limits().0)
                    })
                });
                match got {
                    Ok(got) => Response::json(200, &got),
                    Err(refused) => Response::json(409, &refused),
                }
            }
            Admin::Pins => {
                let (after, limit) = match pins::parse_page(query) {
                    Ok(p) => p,
                    Err(e) => {
                        return Response::text(400, &format!("GET /pins: {e}\n{PINS_QUERY}\n"))
                    }
                };
                let page = kv.with_cache(|c| {
                    let (page, more) = c.pins_page(after.as_ref(), limit);
                    let (limits, over_bound) = c.pin_limits();
                    PinsPage::new(&page, more, &c.pin_count(0), &limits, over_bound)
                });
                Response::json(200, &page)
            }
            Admin::Clear => {
                let (objects, bytes) = kv.with_cache(|c| c.clear());
                Response::json(200, &Dropped { objects, bytes })
            }
            Admin::Evict => {
                let n = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("bytes="))
                    .and_then(|v| kvring::units::parse_bytes(v).ok());
                let Some(n) = n else {
                    return Response::text(
                        400,
                        "POST /evict?bytes=N (N: bytes, K/M/G/KiB/MiB/GiB suffixes)\n",
                    );
                };
                let (objects, bytes) = kv.with_cache(|c| c.evict_bytes(n));
                Response::json(200, &Dropped { objects, bytes })
            }
        }
    }

    /// A reading compared with `first` when given (taken a sample apart),
    /// else with the previous one when that is recent: rings that did not
    /// move between them are flagged. Readings are taken one at a time, so
    /// each is compared with an earlier one.
    fn reading(&self, first: Option<&Snapshot>) -> Snapshot {
        let mut prev = lock(&self.prev);
        let mut s = inspect::snapshot(&self.seg, self.th);
        match (first, prev.as_ref()) {
            (Some(p), _) => inspect::compare(p, &mut s),
            (None, Some(p))
                if s.taken_mono_ns.saturating_sub(p.taken_mono_ns) < COMPARE_WITHIN_NS =>
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

/// The anomalies that make `/healthz` unhealthy: a stall or a
/// contradiction, not a warning.
fn unhealthy(kind: AnomalyKind) -> bool {
    matches!(
        kind,
        AnomalyKind::HeartbeatStopped
            | AnomalyKind::RingStalled
            | AnomalyKind::JobStuck
            | AnomalyKind::LaneStalled
            | AnomalyKind::Inconsistent
            | AnomalyKind::ServerDead
    )
}
