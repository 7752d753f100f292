//! The client library an engine links: connect over the bootstrap socket,
//! submit requests on its ring, and wait for completions.
//!
//! Credits: before a request is submitted, the completion space it may need
//! (`Opcode::completion_bound`) is reserved out of the completion ring's
//! capacity, and returned when its completion is consumed. A client therefore
//! never has more requests in flight than its completion ring can hold, and
//! the server, which checks the same bound before serving, never has to drop
//! or hold back a completion of an honest client.
//!
//! Completions of ring requests arrive in request order (the server serves a
//! client's ring in order and answers every request it serves at once); the
//! library checks this and treats anything else as a protocol error.

pub mod cuda_cache;
mod host_cache;
mod jobs;
mod kv;
mod reconnect;

pub use host_cache::HostKvCache;
pub use kv::{Instance, KvSpec};

use crate::bootstrap::Conn;
use crate::error::{Error, Result};
use crate::proto::{
    BootKind, Goodbye, Hello, Opcode, Status, Welcome, BOOT_MAGIC, PROTOCOL_VERSION,
};
use crate::ring::{Consumer, FrameHeader, Producer, RingError, RingPtrs, HEADER_BYTES};
use crate::rundir::ServerPaths;
use crate::segment::ClientSegment;
use crate::shm::{ServerClientBlock, LAYOUT_VERSION, PAGE};
use crate::wait::{self, Parking, WaitEnd, WaitPolicy};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Options for [`Client::connect_with`].
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long to keep retrying while the server is not up yet.
    pub connect_timeout: Duration,
    /// How waits spin, yield and park (`park_slice` is also how often a
    /// parked wait checks that the server is still there).
    pub wait: WaitPolicy,
    /// How long a synchronous request (a submission that returns a job id,
    /// a control request, a registration) may wait for its answer.
    pub call_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            wait: WaitPolicy::default(),
            call_timeout: Duration::from_secs(10),
        }
    }
}

/// One completion, copied out of the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub opcode: u16,
    pub status: i32,
    pub user_data: u64,
    pub payload: Vec<u8>,
}

struct InFlight {
    user_data: u64,
    reserved: usize,
    /// A synchronous call that timed out: its completion, when it comes, is
    /// consumed and dropped (a job it created is released once finished).
    abandoned: Option<Opcode>,
}

/// A connection to a kvring server.
pub struct Client {
    conn: Conn,
    seg: ClientSegment,
    slot: u32,
    session: u32,
    epoch: u64,
    req: Producer,
    cq: Consumer,
    /// Completion bytes not reserved by any in-flight request.
    credits: usize,
    inflight: VecDeque<InFlight>,
    /// How many of `inflight` are abandoned (kept so no wait scans them).
    abandoned: usize,
    wait: WaitPolicy,
    buf: Vec<u64>,
    name: String,
    /// Where the server is and how to connect, for [`Client::reconnect`].
    paths: ServerPaths,
    opts: ClientOptions,
    /// Every KV cache registered and not unregistered, to register again
    /// after a reconnect.
    registrations: Vec<reconnect::Saved>,
    /// Jobs created by abandoned calls, released once they finish.
    orphans: Vec<crate::jobs::JobId>,
    /// When the server's liveness was last checked by a job status read.
    alive_checked: std::cell::Cell<Instant>,
}

fn server_block(seg: &ClientSegment, slot: u32) -> &ServerClientBlock {
    seg.mapping.server_client(slot)
}

impl Client {
    /// Connects to server `name` in the default runtime directory.
    pub fn connect(name: &str) -> Result<Client> {
        Self::connect_with(&ServerPaths::new(name)?, &ClientOptions::default())
    }

    /// Connects to server `name` in runtime directory `dir`.
    pub fn connect_in(dir: &Path, name: &str) -> Result<Client> {
        Self::connect_with(&ServerPaths::in_dir(name, dir)?, &ClientOptions::default())
    }

    /// Connects with explicit options. Retries with backoff while the socket
    /// does not exist or refuses connections, up to `connect_timeout`.
    pub fn connect_with(paths: &ServerPaths, opts: &ClientOptions) -> Result<Client> {
        crate::rundir::check_runtime_dir(&paths.dir)?;
        let deadline = Instant::now() + opts.connect_timeout;
        let mut backoff = Duration::from_millis(1);
        let conn = loop {
            match Conn::connect(&paths.socket) {
                Ok(c) => break c,
                Err(e) => {
                    let retry = matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    );
                    if !retry || Instant::now() + backoff > deadline {
                        return Err(Error::NoServer {
                            name: paths.name.clone(),
                            path: paths.socket.display().to_string(),
                            reason: e.to_string(),
                        });
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
            }
        };
        let hello = Hello {
            magic: BOOT_MAGIC,
            kind: BootKind::Hello as u32,
            protocol: PROTOCOL_VERSION,
            layout_version: LAYOUT_VERSION,
            _reserved: 0,
        };
        conn.send(bytemuck::bytes_of(&hello), &[])
            .map_err(crate::error::io("send hello"))?;
        let mut buf = [0u8; 128];
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(500));
        let (n, mut fds) = conn.recv(&mut buf, wait).map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut => Error::Timeout(wait),
            _ => Error::Io {
                context: "receive welcome".into(),
                source: e,
            },
        })?;
        if n == 0 {
            return Err(Error::ServerGone);
        }
        if n != std::mem::size_of::<Welcome>() {
            return Err(Error::Protocol(format!("welcome of {n} bytes")));
        }
        let w: Welcome = bytemuck::pod_read_unaligned(&buf[..n]);
        if w.magic != BOOT_MAGIC || w.kind != BootKind::Welcome as u32 {
            return Err(Error::Protocol("not a welcome message".into()));
        }
        if w.status != 0 {
            return Err(Error::Refused(
                Status::from_i32(w.status).unwrap_or(Status::Malformed),
            ));
        }
        if fds.len() != 1 {
            return Err(Error::Protocol(format!(
                "welcome carried {} descriptors, expected 1",
                fds.len()
            )));
        }
        let seg = ClientSegment::attach(&paths.shm_name, fds.pop().expect("one fd"), w.slot)?;
        let info = seg.mapping.info().clone();
        if info.epoch != w.epoch {
            return Err(Error::Protocol(
                "welcome epoch differs from the segment's".into(),
            ));
        }
        let g = info.geometry;
        let sb_off = seg.mapping.server_client_off(w.slot);
        let sb = server_block(&seg, w.slot);
        let cb = seg.block_rw();
        let req = RingPtrs {
            head: &*sb.req_head,
            tail: &*cb.req_tail,
            data: seg.req_data_rw(),
            capacity: g.req_ring_bytes as usize,
            max_frame: g.max_frame_bytes as usize,
        };
        let cq = RingPtrs {
            head: &*cb.cq_head,
            tail: &*sb.cq_tail,
            data: seg
                .mapping
                .words(sb_off + PAGE as u64, u64::from(g.cq_ring_bytes)),
            capacity: g.cq_ring_bytes as usize,
            max_frame: g.max_frame_bytes as usize,
        };
        // SAFETY: both rings lie in mappings owned by `seg`, which the Client
        // keeps alive as long as the producer and consumer; this client is the
        // only producer of its request ring and the only consumer of its
        // completion ring.
        let (req, cq) = unsafe { (Producer::new(req)?, Consumer::new(cq)?) };
        Ok(Client {
            conn,
            seg,
            slot: w.slot,
            session: w.session,
            epoch: w.epoch,
            req,
            cq,
            credits: g.cq_ring_bytes as usize,
            inflight: VecDeque::new(),
            abandoned: 0,
            wait: opts.wait,
            buf: vec![0u64; g.max_frame_bytes as usize / 8],
            name: paths.name.clone(),
            paths: paths.clone(),
            opts: opts.clone(),
            registrations: Vec::new(),
            orphans: Vec::new(),
            alive_checked: std::cell::Cell::new(Instant::now()),
        })
    }

    /// The slot the server assigned.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The server instance's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The server name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The segment as this client maps it.
    pub fn segment(&self) -> &ClientSegment {
        &self.seg
    }

    /// Largest request payload one frame can carry.
    pub fn max_payload(&self) -> usize {
        self.req.max_payload()
    }

    /// Completion credit not reserved by in-flight requests (bytes).
    pub fn credits(&self) -> usize {
        self.credits
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Sets how waits spin, yield and park.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.wait = policy;
    }

    /// Sets how long synchronous requests wait for their answer.
    pub fn set_call_timeout(&mut self, timeout: Duration) {
        self.opts.call_timeout = timeout;
    }

    /// Whether the server has gone (its end of the connection closed).
    pub fn server_gone(&self) -> bool {
        self.conn.peer_closed()
    }

    /// Queues a request without making it visible; [`Client::flush`] publishes
    /// everything queued with one store. Fails with `RingError::TooLarge` when
    /// the payload exceeds the frame bound, and `RingError::Full` when the
    /// request ring or the completion credit is exhausted (consume
    /// completions and retry).
    pub fn enqueue(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
        if payload.len() > self.req.max_payload() {
            return Err(RingError::TooLarge {
                len: payload.len(),
                max: self.req.max_payload(),
            }
            .into());
        }
        let bound = op.completion_bound(payload.len());
        if bound > self.credits {
            return Err(RingError::Full {
                need: bound,
                free: self.credits,
            }
            .into());
        }
        let h = FrameHeader {
            opcode: op as u16,
            session: self.session,
            user_data,
            ..Default::default()
        };
        self.req.write(&h, payload)?;
        self.credits -= bound;
        self.inflight.push_back(InFlight {
            user_data,
            reserved: bound,
            abandoned: None,
        });
        self.show_load();
        Ok(())
    }

    /// Publishes requests in flight and credit in this client's block, for
    /// observers (two stores on a line only this client writes).
    fn show_load(&self) {
        let b = self.seg.block_rw();
        // Observers only: Relaxed.
        b.in_flight
            .store(self.inflight.len() as u32, Ordering::Relaxed);
        b.credits.store(self.credits as u32, Ordering::Relaxed);
    }

    /// Submits a frame exactly as given (opcode, flags, session tag), for
    /// diagnostics and fault tests. With `expect_completion` the frame counts
    /// as in flight like any request (reserving `completion_bound` credit, or
    /// a bare header for an unknown opcode); without it, nothing is expected
    /// back (a frame with a stale session tag is dropped by the server).
    #[doc(hidden)]
    pub fn submit_raw(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        expect_completion: bool,
    ) -> Result<()> {
        let bound = Opcode::from_u16(header.opcode)
            .map_or(HEADER_BYTES, |op| op.completion_bound(payload.len()));
        if expect_completion && bound > self.credits {
            return Err(RingError::Full {
                need: bound,
                free: self.credits,
            }
            .into());
        }
        self.req.write(&header, payload)?;
        if expect_completion {
            self.credits -= bound;
            self.inflight.push_back(InFlight {
                user_data: header.user_data,
                reserved: bound,
                abandoned: None,
            });
            self.show_load();
        }
        self.flush();
        Ok(())
    }

    /// The session tag the server gave this connection.
    pub fn session(&self) -> u32 {
        self.session
    }

    /// Publishes queued requests and wakes the server if it is parked.
    pub fn flush(&mut self) {
        if self.req.publish() {
            let m = &self.seg.mapping;
            wait::notify(Parking {
                sleeping: &m.header().server_sleeping,
                doorbell: &self.seg.doorbell_rw().server_doorbell,
            });
        }
    }

    /// Queues and publishes one request.
    pub fn submit(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
        self.enqueue(op, payload, user_data)?;
        self.flush();
        Ok(())
    }

    /// Takes one completion if there is one. Its payload is copied into
    /// `payload` (cleared first). Returns the header.
    pub fn poll_into(&mut self, payload: &mut Vec<u8>) -> Result<Option<FrameHeader>> {
        let Some(h) = self.take_frame()? else {
            return Ok(None);
        };
        payload.clear();
        payload.extend_from_slice(&bytemuck::cast_slice::<u64, u8>(&self.buf)[..h.len as usize]);
        Ok(Some(h))
    }

    /// Consumes one completion frame (payload left in `self.buf`), returning
    /// its credit.
    fn take_frame(&mut self) -> Result<Option<FrameHeader>> {
        while let Some((h, abandoned)) = self.take_any_frame()? {
            match abandoned {
                Some(op) => {
                    self.abandoned -= 1;
                    self.adopt_orphan(op, &h);
                }
                None => return Ok(Some(h)),
            }
        }
        Ok(None)
    }

    /// A late completion of an abandoned call: a job it created is kept
    /// to be released once it finishes.
    fn adopt_orphan(&mut self, op: Opcode, h: &FrameHeader) {
        let job_op = matches!(
            op,
            Opcode::DelayJob | Opcode::Lookup | Opcode::Store | Opcode::Retrieve
        );
        if job_op && h.status == 0 && h.len as usize == size_of::<crate::jobs::JobId>() {
            let bytes = &bytemuck::cast_slice::<u64, u8>(&self.buf)[..h.len as usize];
            self.orphans.push(bytemuck::pod_read_unaligned(bytes));
        }
    }

    /// Consumes one completion frame, with the opcode of the abandoned call
    /// it answers, if it answers one.
    fn take_any_frame(&mut self) -> Result<Option<(FrameHeader, Option<Opcode>)>> {
        let h = match self.cq.pop(&mut self.buf) {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.cq.release();
        let Some(f) = self.inflight.pop_front() else {
            return Err(Error::Protocol(
                "completion without a request in flight".into(),
            ));
        };
        self.credits += f.reserved;
        self.show_load();
        if f.user_data != h.user_data || h.session != self.session {
            return Err(Error::Protocol(format!(
                "completion for {:#x} (session {}) where {:#x} (session {}) was next",
                h.user_data, h.session, f.user_data, self.session
            )));
        }
        if frame_len(&h) > f.reserved {
            return Err(Error::Protocol("completion larger than its bound".into()));
        }
        Ok(Some((h, f.abandoned)))
    }

    /// Waits for the next completion until `deadline`. Ends with
    /// `Error::Timeout` at the deadline and `Error::ServerGone` as soon as the
    /// server's end of the connection closes.
    pub fn wait_completion(&mut self, deadline: Instant) -> Result<Completion> {
        let mut payload = Vec::new();
        let h = self.wait_into(deadline, &mut payload)?;
        Ok(Completion {
            opcode: h.opcode,
            status: h.status,
            user_data: h.user_data,
            payload,
        })
    }

    /// [`Client::wait_completion`] into a caller-owned buffer (no allocation
    /// once the buffer has grown).
    pub fn wait_into(&mut self, deadline: Instant, payload: &mut Vec<u8>) -> Result<FrameHeader> {
        loop {
            if self.live_in_flight() == 0 {
                return Err(Error::Protocol(
                    "waiting for a completion with nothing in flight".into(),
                ));
            }
            self.wait_frame(deadline)?;
            if let Some(h) = self.take_frame()? {
                payload.clear();
                payload.extend_from_slice(
                    &bytemuck::cast_slice::<u64, u8>(&self.buf)[..h.len as usize],
                );
                return Ok(h);
            }
        }
    }

    /// Waits until a completion frame is in the ring.
    fn wait_frame(&mut self, deadline: Instant) -> Result<()> {
        self.touch();
        let start = Instant::now();
        let seg = &self.seg;
        let parking = Parking {
            sleeping: &seg.block_rw().client_sleeping,
            doorbell: &server_block(seg, self.slot).client_doorbell,
        };
        let cq = &mut self.cq;
        let conn = &self.conn;
        let r = wait::wait_until(
            &self.wait,
            parking,
            deadline,
            || match cq.has_frame() {
                Ok(true) => Some(Ok(())),
                Ok(false) => None,
                Err(e) => Some(Err(e)),
            },
            || if conn.peer_closed() { Err(()) } else { Ok(()) },
        );
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(WaitEnd::Timeout) => {
                return Err(Error::Timeout(deadline.saturating_duration_since(start)))
            }
            Err(WaitEnd::Dead(())) => return Err(Error::ServerGone),
        }
        Ok(())
    }

    /// One PING round trip: the payload comes back unchanged.
    pub fn ping(&mut self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.call(Opcode::Ping, payload, timeout)
    }

    /// One synchronous request: submits it, waits for its completion, and
    /// turns an error status into `Error::Status`. Completions arrive in
    /// order, so other requests may not be in flight.
    ///
    /// When the wait times out the request stays in flight, abandoned: its
    /// completion is dropped when it arrives (and a job it created is
    /// released once it finishes), so the next call works as usual.
    pub fn call(&mut self, op: Opcode, payload: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        self.check_no_call_in_flight(op)?;
        if op != Opcode::ReleaseJob {
            self.release_orphans();
        }
        let tag = 0x4341_4c4c_0000_0000 | op as u64;
        self.submit(op, payload, tag)?;
        self.finish_call(op, Instant::now() + timeout)
    }

    /// A synchronous request may start only when no other request waits
    /// for its completion (completions come in order).
    pub(crate) fn check_no_call_in_flight(&self, op: Opcode) -> Result<()> {
        match self.live_in_flight() {
            0 => Ok(()),
            live => Err(Error::Protocol(format!(
                "synchronous {op:?} while {live} requests are in flight; consume their completions first",
            ))),
        }
    }

    /// Waits for the answer of the synchronous request just submitted (the
    /// newest in flight): its payload, or its error status as an error. At
    /// the deadline the request is abandoned (see [`Client::call`]).
    pub(crate) fn finish_call(&mut self, op: Opcode, deadline: Instant) -> Result<Vec<u8>> {
        let c = match self.wait_completion(deadline) {
            Err(Error::Timeout(d)) => {
                if let Some(f) = self.inflight.back_mut() {
                    f.abandoned = Some(op);
                    self.abandoned += 1;
                }
                return Err(Error::Timeout(d));
            }
            r => r?,
        };
        if c.status != 0 {
            return Err(Error::Status(
                Status::from_i32(c.status).unwrap_or(Status::Malformed),
            ));
        }
        Ok(c.payload)
    }

    /// Requests in flight whose completions someone will wait for.
    fn live_in_flight(&self) -> usize {
        self.inflight.len() - self.abandoned
    }

    /// Releases the finished jobs of abandoned calls (a shared-memory read
    /// each; one RELEASE_JOB per finished job).
    fn release_orphans(&mut self) {
        if self.orphans.is_empty() {
            return;
        }
        let orphans = std::mem::take(&mut self.orphans);
        for id in orphans {
            match self.job_status(id) {
                Ok(s) if s.is_terminal() => {
                    // Best effort: an error here leaves the job to be
                    // tombstoned when this client disconnects.
                    let _ = self.release_job(id);
                }
                Ok(_) => self.orphans.push(id),
                Err(_) => {}
            }
        }
    }

    /// Records that this client is alive and calling in (for observers).
    fn touch(&self) {
        self.seg
            .block_rw()
            .heartbeat_ns
            .store(crate::liveness::monotonic_ns(), Ordering::Relaxed);
    }

    /// Ends the session cleanly: the server frees the slot at once.
    pub fn close(self) {
        drop(self);
    }
}

fn frame_len(h: &FrameHeader) -> usize {
    HEADER_BYTES + (h.len as usize).div_ceil(8) * 8
}

impl Drop for Client {
    fn drop(&mut self) {
        // The rings are unmapped when `seg` drops right after this; the
        // goodbye tells the server it may reuse the slot immediately.
        let g = Goodbye {
            magic: BOOT_MAGIC,
            kind: BootKind::Goodbye as u32,
            _reserved: 0,
        };
        let _ = self.conn.send(bytemuck::bytes_of(&g), &[]);
    }
}
