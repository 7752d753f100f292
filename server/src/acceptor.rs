//! The acceptor thread: bootstrap connections, slot assignment, death
//! detection and reclamation, heartbeat.
//!
//! A slot's life: `Free` -> (hello accepted) `Active` -> (goodbye, EOF, or a
//! kick from the ring loop) `Closing` -> (ring loop detached it, the
//! client's jobs are failed) `Free`, or `Quarantined` while the connection's
//! process is still alive without having said goodbye; the slot leaves
//! quarantine when its pidfd reports the exit. Every reassignment bumps the
//! slot's session tag, so frames of an earlier occupant are never served.

use super::sessions::RingEvent;
use super::Shared;
use kvring::bootstrap::{Conn, Listener};
use kvring::client_memory::OwnedClientMemory;
use kvring::doorbell::{Doorbell, DoorbellReceiver};
use kvring::jobs::FailReason;
use kvring::liveness::{self, PidFd};
use kvring::proto::kv::{split_header, RegisterKv, RegisterReply, UnregisterKv};
use kvring::proto::{BootKind, Hello, Status, Welcome, BOOT_MAGIC, PROTOCOL_VERSION};
use kvring::shm::{DisconnectReason, SlotState, LAYOUT_VERSION};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// Most descriptors a client may send ahead of one registration (a 141 GB
/// cache in PyTorch's 20 MiB VMM chunks is about 7,000).
const MAX_PENDING_FDS: usize = 1 << 16;
/// Largest bootstrap message: the largest registration.
const MAX_BOOT_MESSAGE: usize = kvring::proto::kv::MAX_REGISTER_MESSAGE;

enum Phase {
    Free,
    Active {
        conn: Conn,
        /// The client's process (`SO_PEERCRED`), and a pidfd on it.
        pid: u32,
        pidfd: Option<PidFd>,
        /// Descriptors sent (AttachFds) for the next registration.
        fds: Vec<OwnedFd>,
    },
    Closing {
        pidfd: Option<PidFd>,
        clean: bool,
    },
    Quarantined {
        pidfd: Option<PidFd>,
    },
}

struct Acceptor<'a> {
    shared: &'a Shared,
    slots: Vec<Phase>,
    pending: Vec<(Conn, Instant)>,
    /// Receive buffer for messages on active connections.
    buf: Vec<u8>,
}

impl<'a> Acceptor<'a> {
    fn welcome(&self, status: Status, slot: u32, session: u32) -> Welcome {
        let info = self.shared.seg.mapping.info();
        Welcome {
            magic: BOOT_MAGIC,
            kind: BootKind::Welcome as u32,
            status: status as i32,
            protocol: PROTOCOL_VERSION,
            layout_version: LAYOUT_VERSION,
            slot,
            session,
            epoch: info.epoch,
            segment_bytes: info.segment_bytes,
            server_pid: info.server_pid,
            _reserved: 0,
        }
    }

    fn refuse(&self, conn: Conn, status: Status) {
        tracing::debug!(status = status.name(), "connection refused");
        let w = self.welcome(status, u32::MAX, 0);
        let _ = conn.send(bytemuck::bytes_of(&w), &[]);
        self.shared
            .seg
            .mapping
            .header()
            .clients_refused
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Handles the first message of a new connection.
    fn hello(&mut self, conn: Conn) {
        let mut buf = [0u8; 64];
        let n = match conn.recv(&mut buf, Duration::ZERO) {
            Ok((n, _fds)) => n,
            Err(_) => return,
        };
        if n != std::mem::size_of::<Hello>() {
            return self.refuse(conn, Status::Malformed);
        }
        let h: Hello = bytemuck::pod_read_unaligned(&buf[..n]);
        if h.magic != BOOT_MAGIC || h.kind != BootKind::Hello as u32 {
            return self.refuse(conn, Status::Malformed);
        }
        if h.protocol != PROTOCOL_VERSION || h.layout_version != LAYOUT_VERSION {
            return self.refuse(conn, Status::VersionMismatch);
        }
        let Ok(cred) = conn.peer_cred() else { return };
        if cred.uid != kvring::rundir::euid() {
            return self.refuse(conn, Status::PermissionDenied);
        }
        if self.shared.stop.load(Ordering::Relaxed) {
            return self.refuse(conn, Status::ShuttingDown);
        }
        let Some(slot) = self.slots.iter().position(|p| matches!(p, Phase::Free)) else {
            return self.refuse(conn, Status::NoFreeSlot);
        };
        let slot = slot as u32;
        let m = &self.shared.seg.mapping;
        let info = m.info();
        let sb = m.server_client(slot);
        let r = Ordering::Relaxed;
        // Next session tag; 0 is never used for an occupied slot.
        let session = match sb.session.load(r).wrapping_add(1) {
            0 => 1,
            s => s,
        };
        // The session's own memory (zero-filled: every index starts at 0)
        // and its doorbell.
        let made = OwnedClientMemory::create(
            &kvring::client_memory::name(&info.name, slot, session),
            info.offsets.client_memory_bytes,
            info.offsets.job_words_off,
        )
        .and_then(|(mem, fd)| Ok((mem, fd, Doorbell::pair()?)));
        let (memory, memory_fd, (client_bell, doorbell)) = match made {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a new client's memory");
                return self.refuse(conn, Status::ServerError);
            }
        };
        // Reset the slot: the ring loop does not touch it (it is detached), and
        // the client learns of it only from the welcome sent below.
        sb.kv_instances.store(0, r);
        sb.req_head.store(0, r);
        sb.cq_tail.store(0, r);
        sb.requests_served.store(0, r);
        sb.requests_rejected.store(0, r);
        sb.completions_posted.store(0, r);
        sb.disconnect_reason.store(DisconnectReason::None as u32, r);
        sb.pid.store(cred.pid, r);
        sb.uid.store(cred.uid, r);
        sb.pid_start_ticks
            .store(liveness::process_start_ticks(cred.pid).unwrap_or(0), r);
        sb.connected_unix_ns.store(liveness::unix_ns(), r);
        sb.memory_fd.store(memory.raw_fd(), r);
        sb.session.store(session, r);
        // An observer that sees Active sees the occupant's identity above
        // (see `set_state`).
        set_state(sb, SlotState::Active);

        let memory = Arc::new(memory);
        self.shared.sessions.attach_memory(slot, memory.clone());
        let w = self.welcome(Status::Ok, slot, session);
        let share = self.shared.seg.share_fd();
        let pidfd = PidFd::open(cred.pid).ok();
        self.shared.sessions.push_event(RingEvent::Attach {
            slot,
            session,
            engine: h.engine,
            memory,
            doorbell,
        });
        let h = m.header();
        h.clients_accepted.fetch_add(1, r);
        h.clients_connected.fetch_add(1, r);
        // The segment read-only, the session's memory read-write, the
        // ringing end of its doorbell.
        let fds = [share.as_fd(), memory_fd.as_fd(), client_bell.as_fd()];
        let sent = conn.send(bytemuck::bytes_of(&w), &fds);
        drop((memory_fd, client_bell));
        self.slots[slot as usize] = Phase::Active {
            conn,
            pid: cred.pid,
            pidfd,
            fds: Vec::new(),
        };
        if sent.is_err() {
            self.detach(slot, DisconnectReason::SocketClosed);
        }
    }

    /// Ends a slot's session: closes the connection and asks the ring loop to
    /// let go of the slot. Reclamation finishes in `finish_detach`.
    fn detach(&mut self, slot: u32, reason: DisconnectReason) {
        let phase = std::mem::replace(&mut self.slots[slot as usize], Phase::Free);
        let Phase::Active { conn, pidfd, .. } = phase else {
            self.slots[slot as usize] = phase;
            return;
        };
        drop(conn);
        let sb = self.shared.seg.mapping.server_client(slot);
        sb.disconnect_reason.store(reason as u32, Ordering::Relaxed);
        // A slot seen Closing shows why.
        set_state(sb, SlotState::Closing);
        let clean = reason == DisconnectReason::Goodbye;
        self.slots[slot as usize] = Phase::Closing { pidfd, clean };
        self.shared.sessions.push_event(RingEvent::Detach { slot });
    }

    /// The ring loop has let go of `slot`: release what the client held and
    /// free the slot, or quarantine it while its process lives on.
    fn finish_detach(&mut self, slot: u32) {
        let phase = std::mem::replace(&mut self.slots[slot as usize], Phase::Free);
        let Phase::Closing { pidfd, clean } = phase else {
            self.slots[slot as usize] = phase;
            return;
        };
        let m = &self.shared.seg.mapping;
        let h = m.header();
        // The ring loop serves this slot no more: its jobs end here.
        // Unfinished ones fail with ClientGone, all become tombstones.
        let (failed, released) =
            self.shared
                .jobs
                .client_gone(slot, FailReason::ClientGone, liveness::monotonic_ns());
        h.jobs_failed.fetch_add(failed as u64, Ordering::Relaxed);
        h.jobs_released
            .fetch_add(released as u64, Ordering::Relaxed);
        // Its engine instances and leases end too (copies still running
        // keep their instance's mappings until they finish).
        let kv = &self.shared.kv;
        kv.change_registry(slot, |r| r.client_gone(slot));
        kv.copier.backend.client_gone(slot);
        kv.with_cache(|c| c.drop_leases(Some(slot), std::time::Instant::now()));
        // The session's memory goes (closed and unmapped with its last
        // holder); a process still writing to it reaches nobody.
        self.shared.sessions.release_memory(slot);
        h.clients_connected.fetch_sub(1, Ordering::Relaxed);
        h.clients_reclaimed.fetch_add(1, Ordering::Relaxed);
        let exited = pidfd.as_ref().is_none_or(|p| p.exited());
        let sb = m.server_client(slot);
        if clean || exited {
            set_state(sb, SlotState::Free);
        } else {
            set_state(sb, SlotState::Quarantined);
            self.slots[slot as usize] = Phase::Quarantined { pidfd };
        }
    }

    fn on_message(&mut self, slot: u32) {
        let Phase::Active { conn, .. } = &self.slots[slot as usize] else {
            return;
        };
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(MAX_BOOT_MESSAGE, 0);
        let r = conn.recv(&mut buf, Duration::ZERO);
        match r {
            Ok((0, _)) => self.detach(slot, DisconnectReason::SocketClosed),
            Ok((n, fds)) => {
                if !self.on_boot_message(slot, &buf[..n], fds) {
                    self.detach(slot, DisconnectReason::SocketClosed);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => self.detach(slot, DisconnectReason::SocketClosed),
        }
        self.buf = buf;
    }

    /// One message on an active connection. False: not a message of the
    /// protocol (the connection is ended).
    fn on_boot_message(&mut self, slot: u32, msg: &[u8], fds: Vec<OwnedFd>) -> bool {
        if msg.len() < 12 {
            return false;
        }
        let magic = u64::from_le_bytes(msg[..8].try_into().expect("8 bytes"));
        let kind = u32::from_le_bytes(msg[8..12].try_into().expect("4 bytes"));
        if magic != BOOT_MAGIC {
            return false;
        }
        let Phase::Active {
            conn,
            pid,
            pidfd,
            fds: pending,
        } = &mut self.slots[slot as usize]
        else {
            return false;
        };
        // Relaxed: this thread is the field's only writer.
        let session = self
            .shared
            .seg
            .mapping
            .server_client(slot)
            .session
            .load(Ordering::Relaxed);
        let kv = &self.shared.kv;
        let chunk = kv.chunk_tokens;
        let reply = |conn: &Conn, status: Status, instance: u32, text: &str| {
            let r = RegisterReply::new(status as i32, instance, chunk, text);
            let _ = conn.send(bytemuck::bytes_of(&r), &[]);
        };
        // An unknown kind, or one a client never sends, ends the connection.
        match BootKind::decode(kind) {
            Ok(BootKind::Goodbye) => {
                return self.goodbye(slot);
            }
            Ok(BootKind::AttachFds) => {
                // No reply: a problem is reported at the registration.
                if pending.len() + fds.len() > MAX_PENDING_FDS {
                    pending.clear();
                    return false;
                }
                pending.extend(fds);
            }
            Ok(BootKind::Register) => {
                let mut all = std::mem::take(pending);
                all.extend(fds);
                let Some((req, rest)) = split_header::<RegisterKv>(msg) else {
                    reply(conn, Status::Malformed, 0, "registration message too short");
                    return true;
                };
                let r = kv.change_registry(slot, |reg| {
                    reg.register(
                        slot,
                        session,
                        pidfd.as_ref().map(|p| (*pid, p)),
                        chunk,
                        &req,
                        rest,
                        &all,
                        kv.copier.backend.as_ref(),
                    )
                });
                match r {
                    Ok(inst) => reply(conn, Status::Ok, inst.id, "registered"),
                    Err(r) => reply(conn, r.status, 0, &r.reason),
                }
            }
            Ok(BootKind::Unregister) => {
                if msg.len() != std::mem::size_of::<UnregisterKv>() {
                    reply(conn, Status::Malformed, 0, "bad unregister message");
                    return true;
                }
                let u: UnregisterKv = bytemuck::pod_read_unaligned(msg);
                let gone =
                    kv.change_registry(slot, |reg| reg.unregister(slot, session, u.instance));
                if gone {
                    reply(conn, Status::Ok, u.instance, "unregistered");
                } else {
                    reply(
                        conn,
                        Status::UnknownInstance,
                        u.instance,
                        "no such instance of this client",
                    );
                }
            }
            Ok(BootKind::Hello | BootKind::Welcome | BootKind::RegisterReply) | Err(_) => {
                return false
            }
        }
        true
    }

    /// A goodbye: the client has stopped using its rings.
    fn goodbye(&mut self, slot: u32) -> bool {
        self.detach(slot, DisconnectReason::Goodbye);
        true
    }

    fn poll_once(&mut self, listener: &Listener, bell: &DoorbellReceiver, tick: Duration) {
        let mut fds = vec![libc::pollfd {
            fd: listener.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        for (c, _) in &self.pending {
            fds.push(libc::pollfd {
                fd: c.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let mut active = Vec::new();
        for (i, p) in self.slots.iter().enumerate() {
            if let Phase::Active { conn, .. } = p {
                fds.push(libc::pollfd {
                    fd: conn.raw_fd(),
                    events: libc::POLLIN | libc::POLLRDHUP,
                    revents: 0,
                });
                active.push(i as u32);
            }
        }
        // The ring loop's kicks and detached slots, and a quarantined
        // slot's process exiting (its pidfd turns readable), wake the loop:
        // its housekeeping then disconnects, reclaims or frees the slot at
        // once, not a tick later.
        fds.push(libc::pollfd {
            fd: bell.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for p in &self.slots {
            if let Phase::Quarantined { pidfd: Some(p) } = p {
                fds.push(libc::pollfd {
                    fd: p.as_fd().as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        let ms = tick.as_millis().clamp(1, 1000) as i32;
        // SAFETY: `fds` is a valid array of pollfd for the call's duration.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if r < 0 {
            return;
        }
        let np = self.pending.len();
        // Active connections with activity: a message or the peer's end.
        for (k, slot) in active.iter().enumerate() {
            if fds[1 + np + k].revents != 0 {
                self.on_message(*slot);
            }
        }
        // Hellos.
        let ready: Vec<bool> = (0..np).map(|i| fds[1 + i].revents != 0).collect();
        let pending = std::mem::take(&mut self.pending);
        let now = Instant::now();
        for ((conn, t), ready) in pending.into_iter().zip(ready) {
            if ready {
                self.hello(conn);
            } else if now.duration_since(t) < HELLO_TIMEOUT {
                self.pending.push((conn, t));
            }
        }
        if fds[0].revents != 0 {
            while let Ok(Some(c)) = listener.accept() {
                self.pending.push((c, Instant::now()));
            }
        }
    }

    fn housekeeping(&mut self) {
        let (kicks, detached) = self.shared.sessions.take_kicks();
        for (slot, reason) in kicks {
            self.detach(slot, reason);
        }
        for slot in detached {
            self.finish_detach(slot);
        }
        // Leases past their TTL end.
        let kv = &self.shared.kv;
        kv.with_cache(|c| c.drop_leases(None, std::time::Instant::now()));
        // Lookups whose wait for a chunk being written is over.
        super::kv_ops::wake_lookups(self.shared);
        for i in 0..self.slots.len() {
            if let Phase::Quarantined { pidfd, .. } = &self.slots[i] {
                if pidfd.as_ref().is_none_or(|p| p.exited()) {
                    self.slots[i] = Phase::Free;
                    set_state(
                        self.shared.seg.mapping.server_client(i as u32),
                        SlotState::Free,
                    );
                }
            }
        }
    }
}

/// Stores slot state `state`, and the time it was stored just before it.
fn set_state(sb: &kvring::shm::ServerClientBlock, state: SlotState) {
    // Relaxed: published by the Release store of `state` below.
    sb.state_ns
        .store(liveness::monotonic_ns(), Ordering::Relaxed);
    // Release pairs with the inspector's Acquire load of `state`
    // (`inspect::read_clients`): an observer that sees this state sees the
    // words stored before it (the occupant's identity, the reason, the
    // time).
    sb.state.store(state as u32, Ordering::Release);
}

pub(super) fn run(shared: &Shared, listener: Listener, bell: DoorbellReceiver, tick: Duration) {
    let n = shared.seg.mapping.info().geometry.max_clients as usize;
    let mut a = Acceptor {
        shared,
        slots: (0..n).map(|_| Phase::Free).collect(),
        pending: Vec::new(),
        buf: Vec::new(),
    };
    let h = shared.seg.mapping.header();
    // Acquire pairs with the Release store in `ServerHandle::shutdown`, which
    // comes after every job has ended.
    while !shared.stop_acceptor.load(Ordering::Acquire) {
        // Heartbeat: observers compare it with their own CLOCK_MONOTONIC.
        h.heartbeat_ns
            .store(liveness::monotonic_ns(), Ordering::Relaxed);
        // A counter observers read on its own: Relaxed, no access pairs.
        h.jobs_retired
            .store(shared.jobs.retired(), Ordering::Relaxed);
        // A gauge observers read on its own: Relaxed, no access pairs.
        h.pool_ready_bytes
            .store(shared.kv.pool_ready_bytes(), Ordering::Relaxed);
        // The tiers' states and counters change on their own threads.
        if shared.kv.tiers.is_some() {
            shared.kv.publish();
        }
        a.poll_once(&listener, &bell, tick);
        bell.drain();
        a.housekeeping();
    }
    // Shutdown: close every connection so clients see the end at once.
    for slot in 0..n as u32 {
        a.detach(slot, DisconnectReason::ServerShutdown);
    }
    drop(listener);
}
