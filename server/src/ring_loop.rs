//! The ring loop: serves every active client's request ring.
//!
//! Per client and round it takes at most [`BATCH`] frames (fairness), serves a
//! request only when the completion ring has room for its completion bound
//! (so nothing is ever dropped; an honest client's credits guarantee the
//! room), publishes the completions with one release store, returns the
//! request space with another, and wakes the client only if it is parked.
//! A client whose ring breaks an invariant is kicked, never trusted again.

use super::delay::DelayJobs;
use super::kv_ops;
use super::sessions::RingEvent;
use super::Shared;
use kvring::client_memory::OwnedClientMemory;
use kvring::doorbell::Doorbells;
use kvring::jobs::{JobId, JobKind, NewJob, Released};
use kvring::liveness::monotonic_ns;
use kvring::proto::{DelayJobRequest, Opcode, Status};
use kvring::ring::{
    Consumer, FrameFlags, FrameHeader, Producer, RingError, RingPtrs, HEADER_BYTES,
};
use kvring::shm::DisconnectReason;
use kvring::wait::{self, Parking, WaitPolicy};
use std::borrow::Cow;
use std::mem::size_of;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most requests served from one client before moving to the next.
const BATCH: usize = 256;

struct RingClient<'a> {
    slot: u32,
    session: u32,
    /// The engine the client belongs to (its hello's key).
    engine: [u8; 32],
    req: Consumer,
    cq: Producer,
    /// The session's memory: its block and request ring (read-only here).
    /// `req` points into it; declared after it, so dropped after it.
    memory: Arc<OwnedClientMemory>,
    doorbell: &'a AtomicU32,
    broken: bool,
    /// Completion bytes the next request needs but the ring lacked.
    stalled_on: Option<usize>,
    /// The pieces so far of a request sent in several frames (`FrameFlags::MORE`).
    pending: Vec<u8>,
    pending_op: u16,
    /// The pieces broke a rule (too large, opcodes differ): the last piece
    /// is answered with an error.
    pending_bad: bool,
}

fn attach(
    shared: &Shared,
    slot: u32,
    session: u32,
    engine: [u8; 32],
    memory: Arc<OwnedClientMemory>,
) -> Result<RingClient<'_>, RingError> {
    let m = &shared.seg.mapping;
    let g = m.info().geometry;
    let sb = m.server_client(slot);
    let cb = memory.memory().block();
    let sc_off = m.server_client_off(slot);
    let page = kvring::shm::PAGE as u64;
    let req = RingPtrs {
        head: &*sb.req_head,
        tail: &*cb.req_tail,
        data: memory.memory().req_data(),
        capacity: g.req_ring_bytes as usize,
        max_frame: g.max_frame_bytes as usize,
    };
    let cq = RingPtrs {
        head: &*cb.cq_head,
        tail: &*sb.cq_tail,
        data: m.words(sc_off + page, u64::from(g.cq_ring_bytes)),
        capacity: g.cq_ring_bytes as usize,
        max_frame: g.max_frame_bytes as usize,
    };
    // SAFETY: the server-written halves lie in the server's mapping, which
    // lives as long as `shared`; the client-written halves (the request
    // ring's tail and data, the completion ring's head) lie in the session's
    // memory, which `memory` keeps mapped and the RingClient keeps (it is
    // declared after the rings, so dropped after them). This loop is the
    // only consumer of the request ring and the only producer of the
    // completion ring of this slot, and only loads from the client's memory
    // (mapped read-only).
    let (req, cq) = unsafe { (Consumer::new(req)?, Producer::new(cq)?) };
    Ok(RingClient {
        slot,
        session,
        engine,
        req,
        cq,
        memory,
        doorbell: &sb.client_doorbell,
        broken: false,
        stalled_on: None,
        pending: Vec::new(),
        pending_op: 0,
        pending_bad: false,
    })
}

/// What serving one request produced: a completion (status and payload).
struct Reply<'b> {
    status: Status,
    payload: Cow<'b, [u8]>,
}

impl<'b> Reply<'b> {
    fn ok(payload: impl Into<Cow<'b, [u8]>>) -> Self {
        Reply {
            status: Status::Ok,
            payload: payload.into(),
        }
    }
    fn err(status: Status) -> Self {
        Reply {
            status,
            payload: Cow::Borrowed(&[]),
        }
    }
}

impl<'b> From<kv_ops::Outcome> for Reply<'b> {
    fn from(o: kv_ops::Outcome) -> Self {
        match o {
            Ok(p) => Reply::ok(p),
            Err(s) => Reply::err(s),
        }
    }
}

/// Serves one request whose payload is `req` (already copied out of the
/// ring).
fn execute<'b>(
    shared: &Shared,
    delays: &mut DelayJobs,
    c: &RingClient<'_>,
    op: Option<Opcode>,
    user_data: u64,
    req: &'b [u8],
) -> Reply<'b> {
    let h = shared.seg.mapping.header();
    let who = kv_ops::Caller {
        slot: c.slot,
        session: c.session,
        engine: c.engine,
        user_data,
    };
    match op {
        Some(Opcode::Ping) => Reply::ok(req),
        Some(Opcode::DelayJob) => {
            if req.len() != size_of::<DelayJobRequest>() {
                return Reply::err(Status::BadLength);
            }
            let d: DelayJobRequest = bytemuck::pod_read_unaligned(req);
            if d.validate().is_err() {
                return Reply::err(Status::InvalidArgument);
            }
            let job = NewJob {
                kind: JobKind::Delay,
                owner_slot: c.slot,
                owner_session: c.session,
                user_data,
                now_ns: monotonic_ns(),
            };
            match shared.jobs.submit(job) {
                Ok(id) => {
                    // Counters for observers only: Relaxed.
                    h.jobs_submitted.fetch_add(1, Ordering::Relaxed);
                    delays.schedule(shared, id, c.slot, d, Instant::now());
                    Reply::ok(bytemuck::bytes_of(&id).to_vec())
                }
                Err(e) => {
                    h.jobs_refused.fetch_add(1, Ordering::Relaxed);
                    Reply::err(e.into())
                }
            }
        }
        Some(Opcode::ReleaseJob) => {
            if req.len() != size_of::<JobId>() {
                return Reply::err(Status::BadLength);
            }
            let id: JobId = bytemuck::pod_read_unaligned(req);
            match shared.jobs.release(id, c.slot, c.session, monotonic_ns()) {
                Ok(Released::Now) => {
                    h.jobs_released.fetch_add(1, Ordering::Relaxed);
                    Reply::ok(&[][..])
                }
                Ok(Released::Already) => Reply::ok(&[][..]),
                Err(e) => Reply::err(e.into()),
            }
        }
        Some(Opcode::Lookup) => kv_ops::lookup(shared, who, req).into(),
        Some(Opcode::Store) => kv_ops::store(shared, who, req).into(),
        Some(Opcode::Retrieve) => kv_ops::retrieve(shared, who, req).into(),
        Some(Opcode::FreeLookupLocks) => kv_ops::free_lookup_locks(shared, who, req).into(),
        Some(Opcode::EndSession) => kv_ops::end_session(shared, who, req).into(),
        Some(Opcode::Clear) => kv_ops::clear(shared, req).into(),
        Some(Opcode::Stats) => kv_ops::stats(shared, req).into(),
        Some(Opcode::GetConfig) => kv_ops::config(shared, req).into(),
        Some(Opcode::Describe) => kv_ops::describe(shared, req).into(),
        None => Reply::err(Status::UnknownOpcode),
    }
}

/// Serves up to BATCH requests of one client. Returns how many.
fn serve(
    shared: &Shared,
    delays: &mut DelayJobs,
    c: &mut RingClient<'_>,
    buf: &mut [u64],
) -> Result<usize, RingError> {
    let mut served = 0;
    let mut rejected = 0;
    let mut posted = 0;
    c.stalled_on = None;
    let max_request = shared.kv.max_request_bytes as usize;
    while served + rejected < BATCH {
        let Some(h) = c.req.peek()? else { break };
        let op = Opcode::decode(h.opcode).ok();
        let bound = op.map_or(HEADER_BYTES, |op| op.completion_bound(h.len as usize));
        if h.session != c.session {
            // A previous occupant's late frame: never served, never answered.
            c.req.skip()?;
            rejected += 1;
            continue;
        }
        if !c.cq.has_room(bound)? {
            // Back-pressure: the client has not consumed its completions (an
            // honest client's credits never let this happen).
            c.stalled_on = Some(bound);
            break;
        }
        if FrameFlags::from_bits_retain(h.flags).contains(FrameFlags::MORE) {
            gather(c, buf, max_request)?;
            served += 1;
            continue;
        }
        let h = c.req.pop(buf)?.expect("peeked frame");
        let last = &bytemuck::cast_slice::<u64, u8>(buf)[..h.len as usize];
        let gathered = !c.pending.is_empty() || c.pending_bad;
        let mut whole = std::mem::take(&mut c.pending);
        let bad = std::mem::take(&mut c.pending_bad)
            || (gathered && (c.pending_op != h.opcode || whole.len() + last.len() > max_request));
        // Service time of operations that are not jobs (a job's latency is
        // recorded when it ends); PING is the client's round trip.
        let timed = op.is_some_and(Opcode::timed);
        let t0 = if timed { monotonic_ns() } else { 0 };
        let status = {
            let echo = op.is_some_and(|o| matches!(o.spec().reply, kvring::proto::Reply::Echo));
            let reply = if bad || (gathered && echo) {
                // An echo (PING) carries its payload back, so it must fit one
                // frame: the completion space reserved for it is the last
                // frame's.
                Reply::err(Status::BadLength)
            } else if gathered {
                whole.extend_from_slice(last);
                execute(shared, delays, c, op, h.user_data, &whole)
            } else {
                execute(shared, delays, c, op, h.user_data, last)
            };
            // Never more than the client reserved (and the room checked
            // above): a reply that would not fit is an error reply instead.
            let reply = if kvring::ring::frame_bytes(reply.payload.len()) > bound {
                Reply::err(Status::ServerError)
            } else {
                reply
            };
            c.cq.write(
                &FrameHeader {
                    opcode: h.opcode,
                    session: h.session,
                    user_data: h.user_data,
                    status: reply.status as i32,
                    ..Default::default()
                },
                &reply.payload,
            )?;
            reply.status
        };
        if gathered {
            // Keep the buffer's capacity for the next large request.
            whole.clear();
            c.pending = whole;
        }
        if let Some(o) = op {
            count(shared, o, status, timed.then_some(t0));
        }
        posted += 1;
        if status == Status::Ok {
            served += 1;
        } else {
            rejected += 1;
        }
    }
    if served + rejected > 0 {
        finish_batch(shared, c, served, rejected, posted);
    }
    Ok(served + rejected)
}

/// Takes a piece of a request larger than one frame (flag `MORE`) into
/// the client's pending request: nothing is answered until the last piece.
/// A piece of another operation, or one past `max_request` bytes in all,
/// marks the request bad (refused at its last piece).
#[inline]
fn gather(c: &mut RingClient<'_>, buf: &mut [u64], max_request: usize) -> Result<(), RingError> {
    let h = c.req.pop(buf)?.expect("peeked frame");
    let piece = &bytemuck::cast_slice::<u64, u8>(buf)[..h.len as usize];
    if c.pending.is_empty() {
        c.pending_op = h.opcode;
    }
    if c.pending_op != h.opcode || c.pending.len() + piece.len() > max_request {
        c.pending_bad = true;
    } else {
        c.pending.extend_from_slice(piece);
    }
    Ok(())
}

/// Counts one request of `op` that ended with `status`, and its service
/// time since `started` (monotonic ns) when it is timed.
#[inline]
fn count(shared: &Shared, op: Opcode, status: Status, started: Option<u64>) {
    let st = shared.seg.mapping.op_stats().of(op);
    // Counters for observers only: Relaxed.
    st.count.fetch_add(1, Ordering::Relaxed);
    if status != Status::Ok {
        st.errors.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(t0) = started {
        st.record(monotonic_ns().saturating_sub(t0));
    }
}

/// Ends a batch of a client's requests: counts them, gives their ring
/// space back, publishes their completions and wakes the client if it
/// sleeps.
#[inline]
fn finish_batch(
    shared: &Shared,
    c: &mut RingClient<'_>,
    served: usize,
    rejected: usize,
    posted: usize,
) {
    let sb = shared.seg.mapping.server_client(c.slot);
    // Counters for observers only; Relaxed, single writer. Counted
    // before the completions are published (the completion ring's
    // Release store), so a client that has read a completion finds its
    // request counted.
    sb.requests_served
        .fetch_add(served as u64, Ordering::Relaxed);
    sb.requests_rejected
        .fetch_add(rejected as u64, Ordering::Relaxed);
    sb.completions_posted
        .fetch_add(posted as u64, Ordering::Relaxed);
    c.req.release();
    if c.cq.publish() {
        wait::notify(Parking {
            sleeping: &c.memory.memory().block().client_sleeping,
            doorbell: c.doorbell,
        });
    }
}

pub(super) fn run(shared: &Shared, mut doorbells: Doorbells, policy: WaitPolicy) {
    let m = &shared.seg.mapping;
    let g = m.info().geometry;
    let mut clients: Vec<Option<RingClient<'_>>> = (0..g.max_clients).map(|_| None).collect();
    let mut active: Vec<u32> = Vec::new();
    let mut buf = vec![0u64; g.max_frame_bytes as usize / 8];
    let mut delays = DelayJobs::default();
    let header = m.header();
    loop {
        for ev in shared.sessions.take_events() {
            match ev {
                RingEvent::Attach {
                    slot,
                    session,
                    engine,
                    memory,
                    doorbell,
                } => match attach(shared, slot, session, engine, memory) {
                    Ok(c) if doorbells.add(slot, doorbell).is_ok() => {
                        clients[slot as usize] = Some(c);
                        active.push(slot);
                    }
                    _ => shared.sessions.kick(slot, DisconnectReason::RingCorrupt),
                },
                RingEvent::Detach { slot } => {
                    doorbells.remove(slot);
                    clients[slot as usize] = None;
                    active.retain(|&s| s != slot);
                    shared.sessions.detached(slot);
                }
            }
        }
        // Acquire pairs with the Release store of `stop` in
        // `ServerHandle::shutdown`.
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let mut work = 0;
        for &slot in &active {
            let c = clients[slot as usize].as_mut().expect("active client");
            if c.broken {
                continue;
            }
            match serve(shared, &mut delays, c, &mut buf) {
                Ok(n) => work += n,
                Err(e) => {
                    tracing::warn!(slot, error = %e, "client broke a ring invariant; disconnecting it");
                    c.broken = true;
                    shared.sessions.kick(slot, DisconnectReason::RingCorrupt);
                }
            }
        }
        if delays.next_due().is_some() {
            delays.fire(shared, Instant::now());
        }
        if work > 0 {
            continue;
        }
        // Idle: spin, yield, then park until a client publishes, an event
        // arrives, the next job timer is due, or the housekeeping slice ends.
        let mut deadline = Instant::now() + Duration::from_millis(100);
        if let Some(due) = delays.next_due() {
            deadline = deadline.min(due);
        }

        let parking = Parking {
            sleeping: &header.server_sleeping,
            doorbell: &doorbells,
        };
        let _ = wait::wait_until(
            &policy,
            parking,
            deadline,
            || {
                // Acquire pairs with the Release store in
                // `ServerHandle::shutdown`; `has_events` pairs with
                // `push_event` (the events themselves are taken under their
                // lock).
                if shared.sessions.has_events() || shared.stop.load(Ordering::Acquire) {
                    return Some(());
                }
                for &slot in &active {
                    let c = clients[slot as usize].as_mut().expect("active client");
                    if c.broken {
                        continue;
                    }
                    let ready = match c.stalled_on {
                        Some(need) => c.cq.has_room(need).unwrap_or(true),
                        None => c.req.has_frame().unwrap_or(true),
                    };
                    if ready {
                        return Some(());
                    }
                }
                None
            },
            || Ok::<(), ()>(()),
        );
    }
}
