//! Proving whether a process is alive without trusting a pid alone.
//!
//! * A server holds an open-file-description (OFD) write lock on its segment
//!   for its whole life. The kernel drops the lock when the process dies, so
//!   "lock free" is proof of death, and anyone (even a read-only observer) can
//!   test it with `F_OFD_GETLK` without taking it.
//! * Clients are watched through their bootstrap socket (EOF) and a pidfd,
//!   which refers to one process, never to a later process with the same pid.
//! * Pids recorded in shared memory are paired with the process start time,
//!   so a reused pid does not pass for the original process.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Result of testing a liveness lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockProbe {
    /// Nobody holds the lock: its holder, if any, is dead.
    Free,
    /// A live process holds the lock.
    Held,
}

fn flock_struct(kind: libc::c_short) -> libc::flock {
    // SAFETY: `flock` is plain data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = 0;
    fl.l_len = 1;
    fl
}

/// Takes the OFD write lock on byte 0 of `fd` without blocking. Returns false
/// when another open file description holds it.
pub fn try_lock(fd: BorrowedFd<'_>) -> std::io::Result<bool> {
    let fl = flock_struct(libc::F_WRLCK as libc::c_short);
    // SAFETY: valid fd and a valid flock struct for the duration of the call.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// Tests the OFD write lock on byte 0 of `fd` without taking it. Works on a
/// read-only descriptor.
pub fn probe_lock(fd: BorrowedFd<'_>) -> std::io::Result<LockProbe> {
    let mut fl = flock_struct(libc::F_WRLCK as libc::c_short);
    // SAFETY: valid fd and a valid, writable flock struct.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(if fl.l_type == libc::F_UNLCK as libc::c_short {
        LockProbe::Free
    } else {
        LockProbe::Held
    })
}

/// Start time of process `pid` in clock ticks since boot (field 22 of
/// `/proc/PID/stat`), or None if there is no such process.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain anything;
    // the fields after the last ')' are well formed.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts with field 3 (state); start time is field 22.
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether the process recorded as (`pid`, `start_ticks`) still exists. A
/// different process that reuses the pid has a different start time. A zombie
/// (exited, not yet reaped) counts as dead.
pub fn process_alive(pid: u32, start_ticks: u64) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    let state = fields.next().unwrap_or("X");
    if state == "Z" || state == "X" {
        return false;
    }
    fields.nth(22 - 4).and_then(|s| s.parse::<u64>().ok()) == Some(start_ticks)
}

/// A pidfd: a handle on one process that becomes readable when it exits.
pub struct PidFd(OwnedFd);

impl PidFd {
    /// Opens a pidfd for `pid`.
    pub fn open(pid: u32) -> std::io::Result<PidFd> {
        // SAFETY: pidfd_open takes (pid, flags) and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the syscall returned a fresh fd that we now own.
        Ok(PidFd(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    /// A second handle on the same process.
    pub fn try_clone(&self) -> std::io::Result<PidFd> {
        Ok(PidFd(self.0.try_clone()?))
    }

    /// Whether the process has exited (non-blocking).
    pub fn exited(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        r > 0 && (pfd.revents & (libc::POLLIN | libc::POLLHUP)) != 0
    }
}

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Opens (creating if needed) a lock file with mode 0600.
pub fn open_lock_file(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
}

/// CLOCK_MONOTONIC in nanoseconds: comparable across processes of one boot.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock nanoseconds since the Unix epoch.
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = std::process::id();
        let t = process_start_ticks(me).unwrap();
        assert!(process_alive(me, t));
        assert!(!process_alive(me, t + 1));
        assert!(!process_alive(0, 0));
    }

    #[test]
    fn lock_is_seen_by_a_second_description_and_freed_on_close() {
        let dir = std::env::temp_dir().join(format!("kvring-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.lock");
        let a = open_lock_file(&path).unwrap();
        assert!(try_lock(a.as_fd()).unwrap());
        let b = std::fs::File::open(&path).unwrap(); // read-only
        assert_eq!(probe_lock(b.as_fd()).unwrap(), LockProbe::Held);
        let c = open_lock_file(&path).unwrap();
        assert!(!try_lock(c.as_fd()).unwrap());
        drop(a);
        assert_eq!(probe_lock(b.as_fd()).unwrap(), LockProbe::Free);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pidfd_reports_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.05")
            .spawn()
            .unwrap();
        let fd = PidFd::open(child.id()).unwrap();
        assert!(!fd.exited());
        child.wait().unwrap();
        assert!(fd.exited());
    }
}
