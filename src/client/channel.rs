//! The ring level of a client: completion credits, the in-flight queue,
//! abandoned calls, synchronous calls (one frame or several), and
//! [`RawChannel`], the view of it that [`Client::raw`] hands out.
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

use super::Client;
use crate::error::{Error, Result};
use crate::jobs::JobId;
use crate::proto::Opcode;
use crate::ring::{FrameFlags, FrameHeader, RingError, HEADER_BYTES};
use crate::wait::{self, Parking, WaitEnd};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// One completion, copied out of the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub opcode: u16,
    pub status: i32,
    pub user_data: u64,
    pub payload: Vec<u8>,
}

pub(super) struct InFlight {
    user_data: u64,
    reserved: usize,
    /// A synchronous call that timed out: its completion, when it comes, is
    /// consumed and dropped (a job it created is released once finished).
    abandoned: Option<Opcode>,
    /// The job-words entry and generation of an abandoned STORE or
    /// RETRIEVE: bound to its job when the late answer names it.
    word: Option<(u32, u32)>,
}

/// The ring-level calls of a [`Client`]: queue and publish frames, take
/// completions, make synchronous calls by opcode. For diagnostics, fault
/// tests, benchmarks and operations the KV API does not wrap; everything
/// here keeps the client's credit and ordering checks.
pub struct RawChannel<'a> {
    pub(super) c: &'a mut Client,
}

impl RawChannel<'_> {
    /// Queues a request without making it visible; [`RawChannel::flush`]
    /// publishes everything queued with one store. Fails with
    /// `RingError::TooLarge` when the payload exceeds the frame bound, and
    /// `RingError::Full` when the request ring or the completion credit is
    /// exhausted (consume completions and retry).
    #[inline]
    pub fn enqueue(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
        self.c.enqueue(op, payload, user_data)
    }

    /// Publishes queued requests and wakes the server if it is parked.
    #[inline]
    pub fn flush(&mut self) {
        self.c.flush()
    }

    /// Queues and publishes one request.
    #[inline]
    pub fn submit(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
        self.c.submit(op, payload, user_data)
    }

    /// Submits a frame exactly as given (opcode, flags, session tag), for
    /// diagnostics and fault tests. With `expect_completion` the frame counts
    /// as in flight like any request (reserving `completion_bound` credit, or
    /// a bare header for an unknown opcode); without it, nothing is expected
    /// back (a frame with a stale session tag is dropped by the server).
    #[inline]
    pub fn submit_raw(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        expect_completion: bool,
    ) -> Result<()> {
        self.c.submit_raw(header, payload, expect_completion)
    }

    /// Takes one completion if there is one. Its payload is copied into
    /// `payload` (cleared first). Returns the header.
    #[inline]
    pub fn poll_into(&mut self, payload: &mut Vec<u8>) -> Result<Option<FrameHeader>> {
        self.c.poll_into(payload)
    }

    /// Waits for the next completion until `deadline`. Ends with
    /// `Error::Timeout` at the deadline and `Error::ServerGone` as soon as the
    /// server's end of the connection closes.
    #[inline]
    pub fn wait_completion(&mut self, deadline: Instant) -> Result<Completion> {
        self.c.wait_completion(deadline)
    }

    /// [`RawChannel::wait_completion`] into a caller-owned buffer (no
    /// allocation once the buffer has grown).
    #[inline]
    pub fn wait_into(&mut self, deadline: Instant, payload: &mut Vec<u8>) -> Result<FrameHeader> {
        self.c.wait_into(deadline, payload)
    }

    /// One synchronous request: submits it, waits for its completion until
    /// `deadline`, and turns an error status into `Error::Status`.
    /// Completions arrive in order, so other requests may not be in flight
    /// (`Error::CallInFlight`).
    ///
    /// When the wait times out the request stays in flight, abandoned: its
    /// completion is dropped when it arrives (and a job it created is
    /// released once it finishes), so the next call works as usual.
    #[inline]
    pub fn call(&mut self, op: Opcode, payload: &[u8], deadline: Instant) -> Result<Vec<u8>> {
        self.c.call(op, payload, deadline)
    }

    /// [`RawChannel::call`] for a request of any size up to the server's
    /// `max_request_bytes`: split over frames when it exceeds one, answered
    /// once.
    #[inline]
    pub fn call_large(&mut self, op: Opcode, payload: &[u8], deadline: Instant) -> Result<Vec<u8>> {
        self.c.call_large(op, payload, deadline)
    }

    /// Unregisters the KV cache the server knows by `instance`, whatever
    /// this client holds (for fault tests: the [`super::Registration`]
    /// handles are the way to unregister).
    #[inline]
    pub fn unregister(&mut self, instance: u32) -> Result<()> {
        self.c.send_unregister(instance)
    }

    /// Sends a registration of `layout` in `memory` as it is, without the
    /// checks [`Client::register`] makes before sending (for fault tests:
    /// what the server accepts and refuses), and returns the server's
    /// instance id. Nothing is kept: no handle, no re-registration on
    /// reconnect.
    pub fn register(
        &mut self,
        spec: &crate::KvSpec,
        layout: &crate::kv::KvLayout,
        memory: &super::Memory,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<u32> {
        self.c.send_releases();
        let saved = super::reconnect::Saved::new(
            spec,
            std::sync::Arc::new(layout.clone()),
            memory.kind(),
            memory.tables_unchecked(layout),
            fds,
        )?;
        Ok(self.c.send_unchecked(&saved)?.0)
    }

    /// Completion credit not reserved by in-flight requests (bytes).
    #[inline]
    pub fn credits(&self) -> usize {
        self.c.credits
    }

    /// Requests submitted and not yet completed.
    #[inline]
    pub fn in_flight(&self) -> usize {
        self.c.inflight.len()
    }

    /// Largest request payload one frame can carry.
    #[inline]
    pub fn max_payload(&self) -> usize {
        self.c.req.max_payload()
    }

    /// The session tag the server gave this connection.
    #[inline]
    pub fn session(&self) -> u32 {
        self.c.link.session
    }
}

impl Client {
    pub(super) fn enqueue(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
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
            session: self.link.session,
            user_data,
            ..Default::default()
        };
        self.req.write(&h, payload)?;
        self.credits -= bound;
        self.inflight.push_back(InFlight {
            user_data,
            reserved: bound,
            abandoned: None,
            word: None,
        });
        self.show_load();
        Ok(())
    }

    /// Writes a request whose answer nobody waits for (published with the
    /// next flush): its completion is consumed and dropped when it arrives,
    /// as an abandoned call's is.
    pub(super) fn post(&mut self, op: Opcode, payload: &[u8]) -> Result<()> {
        self.enqueue(op, payload, 0x504f_5354_0000_0000 | op as u64)?;
        if let Some(f) = self.inflight.back_mut() {
            f.abandoned = Some(op);
            self.abandoned += 1;
        }
        Ok(())
    }

    /// Publishes requests in flight and credit in this client's block, for
    /// observers (two stores on a line only this client writes).
    fn show_load(&self) {
        let b = self.link.seg.block_rw();
        // Observers only: Relaxed.
        b.in_flight
            .store(self.inflight.len() as u32, Ordering::Relaxed);
        // Observers only: Relaxed.
        b.credits.store(self.credits as u32, Ordering::Relaxed);
    }

    pub(super) fn submit_raw(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        expect_completion: bool,
    ) -> Result<()> {
        let bound = Opcode::decode(header.opcode).ok()
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
                word: None,
            });
            self.show_load();
        }
        self.flush();
        Ok(())
    }

    pub(super) fn flush(&mut self) {
        if self.req.publish() {
            let seg = &self.link.seg;
            wait::notify(Parking {
                sleeping: &seg.mapping.header().server_sleeping,
                doorbell: seg.doorbell(),
            });
        }
    }

    pub(super) fn submit(&mut self, op: Opcode, payload: &[u8], user_data: u64) -> Result<()> {
        self.enqueue(op, payload, user_data)?;
        self.flush();
        Ok(())
    }

    pub(super) fn poll_into(&mut self, payload: &mut Vec<u8>) -> Result<Option<FrameHeader>> {
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
        while let Some((h, abandoned, word)) = self.take_any_frame()? {
            match abandoned {
                Some(op) => {
                    self.abandoned -= 1;
                    self.adopt_orphan(op, &h, word);
                }
                None => return Ok(Some(h)),
            }
        }
        Ok(None)
    }

    /// A late completion of an abandoned call: a job it created is kept
    /// to be released once it finishes, and a STORE's or RETRIEVE's entry
    /// in the job words is bound to it (freed once it ended), or given back
    /// if the server refused it.
    fn adopt_orphan(&mut self, op: Opcode, h: &FrameHeader, word: Option<(u32, u32)>) {
        let job_op = matches!(
            op,
            Opcode::DelayJob | Opcode::Lookup | Opcode::Store | Opcode::Retrieve
        );
        if job_op && h.status == 0 && h.len as usize == size_of::<JobId>() {
            let bytes = &bytemuck::cast_slice::<u64, u8>(&self.buf)[..h.len as usize];
            let id: JobId = bytemuck::pod_read_unaligned(bytes);
            if let Some((entry, _)) = word {
                self.link.words.bind(entry, id);
            }
            if op == Opcode::Lookup {
                // A lease nobody will use: ended once its lookup finished.
                self.lease_ends.push(id);
            } else {
                self.orphans.push(id);
            }
        } else if let Some((entry, _)) = word.filter(|_| h.status != 0) {
            // Refused: nothing of it ran.
            self.link.words.put_back(entry);
        }
    }

    /// Consumes one completion frame, with the opcode (and job-words entry)
    /// of the abandoned call it answers, if it answers one.
    #[allow(clippy::type_complexity)]
    fn take_any_frame(
        &mut self,
    ) -> Result<Option<(FrameHeader, Option<Opcode>, Option<(u32, u32)>)>> {
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
        if f.user_data != h.user_data || h.session != self.link.session {
            return Err(Error::Protocol(format!(
                "completion for {:#x} (session {}) where {:#x} (session {}) was next",
                h.user_data, h.session, f.user_data, self.link.session
            )));
        }
        if frame_len(&h) > f.reserved {
            return Err(Error::Protocol("completion larger than its bound".into()));
        }
        Ok(Some((h, f.abandoned, f.word)))
    }

    pub(super) fn wait_completion(&mut self, deadline: Instant) -> Result<Completion> {
        let mut payload = Vec::new();
        let h = self.wait_into(deadline, &mut payload)?;
        Ok(Completion {
            opcode: h.opcode,
            status: h.status,
            user_data: h.user_data,
            payload,
        })
    }

    pub(super) fn wait_into(
        &mut self,
        deadline: Instant,
        payload: &mut Vec<u8>,
    ) -> Result<FrameHeader> {
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
        self.link.touch();
        let start = Instant::now();
        let link = &*self.link;
        let cq = &mut self.cq;
        let r = wait::wait_until(
            &link.wait,
            link.parking(),
            deadline,
            || match cq.has_frame() {
                Ok(true) => Some(Ok(())),
                Ok(false) => None,
                Err(e) => Some(Err(e)),
            },
            || {
                if link.conn.peer_closed() {
                    Err(())
                } else {
                    Ok(())
                }
            },
        );
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(WaitEnd::Timeout) => Err(Error::Timeout(start.elapsed())),
            Err(WaitEnd::Dead(())) => Err(Error::ServerGone),
        }
    }

    pub(super) fn call(
        &mut self,
        op: Opcode,
        payload: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>> {
        self.check_no_call_in_flight(op)?;
        self.send_releases();
        let tag = 0x4341_4c4c_0000_0000 | op as u64;
        self.submit(op, payload, tag)?;
        self.finish_call(op, deadline)
    }

    /// A synchronous call with the client's `call_timeout`.
    pub(super) fn call_now(&mut self, op: Opcode, payload: &[u8]) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.opts.call_timeout;
        self.call_large(op, payload, deadline)
    }

    pub(super) fn call_large(
        &mut self,
        op: Opcode,
        payload: &[u8],
        deadline: Instant,
    ) -> Result<Vec<u8>> {
        let max = self.req.max_payload();
        if payload.len() <= max {
            return self.call(op, payload, deadline);
        }
        self.check_no_call_in_flight(op)?;
        self.send_releases();
        let start = Instant::now();
        let pieces: Vec<&[u8]> = payload.chunks(max).collect();
        let tag = 0x4c52_4745_0000_0000 | op as u64;
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let h = FrameHeader {
                opcode: op as u16,
                flags: if last { 0 } else { FrameFlags::MORE.bits() },
                session: self.link.session,
                user_data: tag,
                ..Default::default()
            };
            loop {
                let r = if last {
                    self.enqueue(op, piece, tag)
                } else {
                    self.req.write(&h, piece).map_err(Error::from)
                };
                match r {
                    Ok(()) => break,
                    Err(Error::Ring(RingError::Full { .. })) => {
                        // The server drains the ring as we go: publish what
                        // is written and wait for room.
                        self.flush();
                        if Instant::now() > deadline {
                            return Err(Error::Timeout(start.elapsed()));
                        }
                        if self.server_gone() {
                            return Err(Error::ServerGone);
                        }
                        std::thread::yield_now();
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        self.flush();
        self.finish_call(op, deadline)
    }

    /// A synchronous request may start only when no other request waits
    /// for its completion (completions come in order).
    pub(super) fn check_no_call_in_flight(&self, op: Opcode) -> Result<()> {
        match self.live_in_flight() {
            0 => Ok(()),
            in_flight => Err(Error::CallInFlight { op, in_flight }),
        }
    }

    /// Waits for the answer of the synchronous request just submitted (the
    /// newest in flight): its payload, or its error status as an error. At
    /// the deadline the request is abandoned (see [`RawChannel::call`]).
    fn finish_call(&mut self, op: Opcode, deadline: Instant) -> Result<Vec<u8>> {
        let word = self.call_word.take();
        let c = match self.wait_completion(deadline) {
            Err(Error::Timeout(d)) => {
                if let Some(f) = self.inflight.back_mut() {
                    f.abandoned = Some(op);
                    f.word = word;
                    self.abandoned += 1;
                }
                return Err(Error::Timeout(d));
            }
            r => r?,
        };
        if c.status != 0 {
            return Err(crate::error::status(c.status));
        }
        Ok(c.payload)
    }

    /// Requests in flight whose completions someone will wait for.
    pub(super) fn live_in_flight(&self) -> usize {
        self.inflight.len() - self.abandoned
    }
}

fn frame_len(h: &FrameHeader) -> usize {
    HEADER_BYTES + (h.len as usize).div_ceil(8) * 8
}

/// A request's bytes: its header, then each part in order.
pub(super) fn payload(header: &impl bytemuck::Pod, parts: &[&[u8]]) -> Vec<u8> {
    let mut v = bytemuck::bytes_of(header).to_vec();
    for p in parts {
        v.extend_from_slice(p);
    }
    v
}
