//! Whether the machine can hold what a server is configured for: its
//! segment in the shared-memory mount (a segment larger than the free space
//! there starts, then dies of SIGBUS once touched) and its pool plus segment
//! in available memory. Checked before a start touches anything, so a
//! server that cannot run refuses at once, naming the limit.

use kvring::error::{Error, Result};
use std::path::Path;

/// Where POSIX shared memory lives on Linux.
const SHM_MOUNT: &str = "/dev/shm";

/// Bytes free for an unprivileged user in the file system at `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    Some(s.blocks_available().saturating_mul(s.fragment_size()))
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

fn gib(v: u64) -> String {
    format!("{:.2} GiB", v as f64 / f64::from(1u32 << 30))
}

/// Refuses a segment of `segment_bytes` that does not fit the free space of
/// the shared-memory mount, and a pool of `pool_bytes` that, with the
/// segment, exceeds available memory. A limit that cannot be read is not
/// checked.
pub fn check(segment_bytes: u64, pool_bytes: u64) -> Result<()> {
    if let Some(free) = free_bytes(Path::new(SHM_MOUNT)) {
        if segment_bytes > free {
            return Err(Error::Config(format!(
                "the segment needs {} but {SHM_MOUNT} has {} free: fewer clients, job slots or smaller rings, a larger {SHM_MOUNT}, or --allow-oversize",
                gib(segment_bytes),
                gib(free)
            )));
        }
    }
    if let Some(avail) = available_memory() {
        let need = pool_bytes.saturating_add(segment_bytes);
        if need > avail {
            return Err(Error::Config(format!(
                "the pool, segment and client memory need {} but only {} of memory is available (MemAvailable): a smaller --pool-bytes, fewer clients, or --allow-oversize",
                gib(need),
                gib(avail)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn refuses_what_the_machine_cannot_hold_and_names_the_limit() {
        super::check(1 << 20, 1 << 20).unwrap();
        let e = super::check(1 << 60, 0).unwrap_err().to_string();
        assert!(
            e.contains("/dev/shm") && e.contains("--allow-oversize"),
            "{e}"
        );
        let e = super::check(1 << 20, 1 << 60).unwrap_err().to_string();
        assert!(e.contains("MemAvailable"), "{e}");
    }
}
