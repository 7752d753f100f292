//! Whether the disk answers: the disk tier is down after an I/O error
//! (until a probe of the directory succeeds, tried after a pause that
//! doubles while the disk keeps failing), and while one operation has been
//! under way for longer than [`STALL`] (a disk that stopped answering: the
//! tier's thread is stuck in the kernel, and only the disk can end that).
//! While down, the owner hands the tier nothing: writes are dropped and
//! lookups skip it, counted, and the rings never wait on it.

use super::aligned::{AlignedBuf, BLOCK};
use kvring::liveness::monotonic_ns;
use kvring::proto::kv::TierState;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// An operation under way for longer than this marks the tier down.
pub const STALL: Duration = Duration::from_secs(5);
/// The first pause before a probe, and the longest.
pub const FIRST_PAUSE: Duration = Duration::from_secs(2);
pub const MAX_PAUSE: Duration = Duration::from_secs(60);

/// The file a probe writes and reads back.
pub const PROBE_FILE: &str = "kvring-disk.probe";

/// What observers read: down, and how long the operation under way runs.
#[derive(Default)]
pub(crate) struct Health {
    /// Down after an error, until a probe succeeds (the tier's thread
    /// writes it).
    down: AtomicBool,
    /// CLOCK_MONOTONIC ns when the operation under way started; 0: none.
    busy_since: AtomicU64,
}

impl Health {
    /// Up, or down (after errors, or stuck in an operation).
    pub fn state(&self) -> TierState {
        // Relaxed (both): each word is a whole fact on its own; nothing
        // read after depends on them (the owner only decides what to
        // submit).
        let since = self.busy_since.load(Ordering::Relaxed);
        let stuck = since != 0 && monotonic_ns().saturating_sub(since) > STALL.as_nanos() as u64;
        if stuck || self.down.load(Ordering::Relaxed) {
            TierState::Down
        } else {
            TierState::Up
        }
    }

    /// Whether the tier is down after errors (the thread's own view: a
    /// stuck operation is the thread itself).
    pub fn is_down(&self) -> bool {
        // Relaxed: only the tier's thread stores it.
        self.down.load(Ordering::Relaxed)
    }

    /// Runs `op`, an operation on the disk, marked as under way.
    pub fn during<T>(&self, op: impl FnOnce() -> T) -> T {
        // Relaxed: a timestamp observers read on its own (see `state`).
        self.busy_since
            .store(monotonic_ns().max(1), Ordering::Relaxed);
        let r = op();
        self.busy_since.store(0, Ordering::Relaxed);
        r
    }

    fn set_down(&self, down: bool) {
        // Relaxed: see `state`.
        self.down.store(down, Ordering::Relaxed);
    }
}

/// The tier's thread's side: when to probe, and how long to wait after.
pub(crate) struct Backoff {
    dir: PathBuf,
    pause: Duration,
    /// Down since an error: probe at this instant.
    probe_at: Option<Instant>,
}

impl Backoff {
    pub fn new(dir: &Path) -> Backoff {
        Backoff {
            dir: dir.to_path_buf(),
            pause: FIRST_PAUSE,
            probe_at: None,
        }
    }

    /// An operation failed with an I/O error: the tier goes down until a
    /// probe after the pause succeeds.
    pub fn failed(&mut self, h: &Health) {
        if self.probe_at.is_none() {
            tracing::warn!(
                dir = %self.dir.display(),
                pause_s = self.pause.as_secs_f64(),
                "disk tier: down after an I/O error; writes are dropped and lookups skip it until a probe succeeds"
            );
        }
        self.probe_at = Some(Instant::now() + self.pause);
        h.set_down(true);
    }

    /// An operation succeeded: the next failure starts from the first pause.
    pub fn succeeded(&mut self) {
        if self.probe_at.is_none() {
            self.pause = FIRST_PAUSE;
        }
    }

    /// Probes the directory if the pause is over: up again if the probe
    /// succeeds, else down for twice as long.
    pub fn tick(&mut self, h: &Health) {
        let Some(at) = self.probe_at else {
            return;
        };
        if Instant::now() < at {
            return;
        }
        match h.during(|| probe(&self.dir)) {
            Ok(()) => {
                tracing::info!(dir = %self.dir.display(), "disk tier: up again (a probe succeeded)");
                self.probe_at = None;
                self.pause = FIRST_PAUSE;
                h.set_down(false);
            }
            Err(e) => {
                self.pause = (self.pause * 2).min(MAX_PAUSE);
                self.probe_at = Some(Instant::now() + self.pause);
                tracing::warn!(
                    dir = %self.dir.display(),
                    error = %e,
                    pause_s = self.pause.as_secs_f64(),
                    "disk tier: a probe failed; still down"
                );
            }
        }
    }
}

/// Writes one block to the probe file with direct I/O (the page cache
/// where the file system has none), syncs it and reads it back.
fn probe(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(PROBE_FILE);
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true).create(true).truncate(false);
    let f = match o.clone().custom_flags(libc::O_DIRECT).open(&path) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => o.open(&path)?,
        r => r?,
    };
    let mut block = AlignedBuf::zeroed(BLOCK);
    let stamp = monotonic_ns().to_le_bytes();
    block[..8].copy_from_slice(&stamp);
    f.write_all_at(&block, 0)?;
    f.sync_data()?;
    let mut back = AlignedBuf::zeroed(BLOCK);
    f.read_exact_at(&mut back, 0)?;
    if back[..8] != stamp {
        return Err(std::io::Error::other("the probe block read back differs"));
    }
    Ok(())
}
