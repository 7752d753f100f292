//! Connecting: the bootstrap handshake, attaching the segment, and the two
//! rings of this client's slot. What the client and its handles share
//! afterwards is a [`Link`].

use super::{Client, ClientOptions};
use crate::bootstrap::Conn;
use crate::error::{Error, Result};
use crate::shm::{ServerClientBlock, PAGE};
use crate::proto::{BootKind, Hello, Welcome, BOOT_MAGIC};
use crate::ring::{Consumer, Producer, RingPtrs};
use crate::rundir::ServerPaths;
use crate::segment::ClientSegment;
use crate::wait::{Parking, WaitPolicy};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One connection as the client and its handles ([`super::Job`],
/// [`super::Lease`]) see it: the socket (whose closing says the server is
/// gone), the mapped segment (the job table and the doorbells), and who this
/// client is. Handles keep it alive with an `Arc`, so they read the job
/// table without borrowing the client.
pub(crate) struct Link {
    /// This session's job words registered with the CUDA driver (for
    /// engine streams that wait on them), at the first such wait; declared
    /// before `seg` so it is unregistered before the memory is unmapped.
    #[cfg(feature = "cuda")]
    pub words_registered: std::sync::Mutex<Option<crate::gpu::HostRegistration>>,
    /// Which entry each STORE and RETRIEVE in flight has.
    pub words: Arc<super::words::WordTable>,
    /// The server process (opened at connect, its start time checked), to
    /// prove its exit: a process that has exited copies nothing more.
    server: Option<crate::liveness::PidFd>,
    /// The process that connected (the server knows this one's memory).
    pub pid: u32,
    pub conn: Conn,
    pub seg: ClientSegment,
    pub slot: u32,
    pub session: u32,
    pub epoch: u64,
    /// This connection among every connection of this process (a reconnect
    /// to the same server keeps its epoch but not this).
    pub id: u64,
    pub wait: WaitPolicy,
    /// When the server's liveness was last checked by a job status read
    /// (`liveness::monotonic_ns`).
    alive_checked_ns: AtomicU64,
    /// Set when the client said goodbye: the server may give this slot to
    /// another client, so handles that outlive the client no longer write
    /// to the slot's block (no parked waits, no heartbeats).
    closed: AtomicBool,
}

/// How often a status poll that reads a non-terminal state also checks that
/// the server is still there (a non-blocking poll of the bootstrap socket).
const ALIVE_CHECK_EVERY: Duration = Duration::from_millis(1);

impl Link {
    pub fn server_block(&self) -> &ServerClientBlock {
        self.seg.mapping.server_client(self.slot)
    }

    /// The futex pair the server rings when something for this client is
    /// ready (a completion, a job of this client finished).
    pub fn parking(&self) -> Parking<'_> {
        Parking {
            sleeping: &self.seg.block_rw().client_sleeping,
            doorbell: &self.server_block().client_doorbell,
        }
    }

    /// This session's job words.
    pub fn words(&self) -> crate::job_words::Words<'_> {
        self.seg
            .memory()
            .words()
            .expect("a client's memory is mapped writable")
    }

    /// Whether the server process has exited (false when that cannot be
    /// proven: its pid could not be opened at connect).
    pub fn server_exited(&self) -> bool {
        self.server.as_ref().is_some_and(|p| p.exited())
    }

    /// Whether the server is gone: its end of the connection closed.
    #[cfg(feature = "cuda")]
    pub fn server_gone(&self) -> bool {
        self.conn.peer_closed()
    }

    /// `Err(ServerGone)` once the server's end of the connection closed;
    /// polls the socket at most every [`ALIVE_CHECK_EVERY`].
    pub fn check_alive(&self) -> Result<()> {
        let now = crate::liveness::monotonic_ns();
        // A rate limit only: Relaxed.
        let last = self.alive_checked_ns.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= ALIVE_CHECK_EVERY.as_nanos() as u64 {
            if self.conn.peer_closed() {
                return Err(Error::ServerGone);
            }
            // A rate limit only: Relaxed.
            self.alive_checked_ns.store(now, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Marks the connection closed (the client is saying goodbye).
    pub fn close(&self) {
        // Release: pairs with the Acquire in `jobs`; the goodbye that
        // lets the server reuse the slot is sent after this store.
        self.closed.store(true, Ordering::Release);
    }

    /// The job table, for a connection that is still open: a handle that
    /// outlived its client gets `ClientClosed`, never a read of a slot the
    /// server may have given to another client.
    pub fn jobs(&self) -> Result<crate::jobs::JobReader<'_>> {
        // Acquire: pairs with the Release in `close`.
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::ClientClosed);
        }
        Ok(self.seg.mapping.job_reader())
    }

    /// Records that this client is alive and calling in (for observers).
    pub fn touch(&self) {
        // Observers only: Relaxed.
        self.seg
            .block_rw()
            .heartbeat_ns
            .store(crate::liveness::monotonic_ns(), Ordering::Relaxed);
    }
}

/// Connects with retry, shakes hands and attaches the rings.
/// Connects to the server's socket by `deadline`, waiting (with backoff)
/// while it is not there or refuses: a server not started yet, or one
/// starting.
fn dial(paths: &ServerPaths, deadline: Instant) -> Result<Conn> {
    // A runtime directory that does not exist yet is a server not started
    // yet (one may be starting): waited for like its socket. One that
    // exists is checked before its socket is trusted.
    let mut dir_checked = false;
    let mut backoff = Duration::from_millis(1);
    loop {
        if !dir_checked && paths.dir.exists() {
            crate::rundir::check_runtime_dir(&paths.dir)?;
            dir_checked = true;
        }
        match Conn::connect(&paths.socket) {
            Ok(c) if dir_checked => return Ok(c),
            // The directory appeared between the check and the connect.
            Ok(_) => continue,
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
    }
}

/// Says hello (with the engine's key) and reads the welcome: the slot,
/// session and epoch, and the descriptors it carries.
fn handshake(
    conn: &Conn,
    opts: &ClientOptions,
    deadline: Instant,
) -> Result<(Welcome, Vec<std::os::fd::OwnedFd>)> {
    let hello = Hello::new(
        opts.engine
            .as_deref()
            .map_or([0; 32], crate::kv::engine_key),
    );
    conn.send(bytemuck::bytes_of(&hello), &[])
        .map_err(crate::error::io("send hello"))?;
    let mut buf = [0u8; 128];
    // What is left of the deadline, and at least the whole timeout (up to
    // 500 ms) when waiting for the socket took most of it: a server that
    // just came up still gets its chance to answer, and a connect never
    // takes more than twice its timeout (a stopped server's costs a caller
    // with a short timeout that, not half a second).
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(opts.connect_timeout.min(Duration::from_millis(500)));
    let (n, fds) = conn.recv(&mut buf, wait).map_err(|e| match e.kind() {
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
        return Err(match crate::proto::Status::decode(w.status).ok() {
            Some(s) => Error::Refused(s),
            None => Error::UnknownStatus(w.status),
        });
    }
    Ok((w, fds))
}

pub(super) fn connect(paths: &ServerPaths, opts: &ClientOptions) -> Result<Client> {
    let deadline = Instant::now() + opts.connect_timeout;
    let conn = dial(paths, deadline)?;
    let (w, fds) = handshake(&conn, opts, deadline)?;
    // The segment (read-only), this session's memory, its doorbell.
    let Ok([segment, memory, doorbell]) = <[_; 3]>::try_from(fds) else {
        return Err(Error::Protocol(
            "welcome did not carry the segment, the client's memory and its doorbell".into(),
        ));
    };
    let seg = ClientSegment::attach(&paths.shm_name, segment, memory, doorbell, w.slot)?;
    let info = seg.mapping.info().clone();
    if info.epoch != w.epoch {
        return Err(Error::Protocol(
            "welcome epoch differs from the segment's".into(),
        ));
    }
    // The pid is checked against the start time after the pidfd is open, so
    // the pidfd is the server's, not a later process with a reused pid.
    let server = crate::liveness::PidFd::open(info.server_pid)
        .ok()
        .filter(|_| crate::liveness::process_alive(info.server_pid, info.server_start_ticks));
    let link = Arc::new(Link {
        #[cfg(feature = "cuda")]
        words_registered: std::sync::Mutex::new(None),
        words: Arc::new(super::words::WordTable::new()),
        server,
        pid: std::process::id(),
        conn,
        seg,
        slot: w.slot,
        session: w.session,
        epoch: w.epoch,
        id: {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            // Relaxed: a unique number is all that is asked of it.
            NEXT.fetch_add(1, Ordering::Relaxed)
        },
        wait: opts.wait,
        alive_checked_ns: AtomicU64::new(crate::liveness::monotonic_ns()),
        closed: AtomicBool::new(false),
    });
    // The session's memory is new (zero): say this client is alive.
    link.touch();
    let g = info.geometry;
    let seg = &link.seg;
    let sb_off = seg.mapping.server_client_off(w.slot);
    let sb = link.server_block();
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
    // SAFETY: both rings lie in mappings owned by `link.seg`, which the
    // Client keeps alive (through its `Arc<Link>`) as long as the producer
    // and consumer; this client is the only producer of its request ring and
    // the only consumer of its completion ring.
    let (req, cq) = unsafe { (Producer::new(req)?, Consumer::new(cq)?) };
    Ok(Client {
        req,
        cq,
        credits: g.cq_ring_bytes as usize,
        inflight: Default::default(),
        abandoned: 0,
        buf: vec![0u64; g.max_frame_bytes as usize / 8],
        link,
        paths: paths.clone(),
        opts: opts.clone(),
        registrations: Vec::new(),
        orphans: Vec::new(),
        lease_ends: Vec::new(),
        call_word: None,
        releases: Default::default(),
        late_boot_replies: 0,
    })
}
