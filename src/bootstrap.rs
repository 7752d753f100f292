//! The bootstrap socket: a Unix `SOCK_SEQPACKET` socket in the per-user
//! runtime directory. A client connects, the server checks its uid
//! (SO_PEERCRED), assigns a slot and sends the segment descriptor
//! (SCM_RIGHTS). The connection stays open for the session: its end is how
//! each side learns at once that the other died, and it carries descriptors
//! for later memory registration.

use nix::sys::socket::{
    self, sockopt, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr,
};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Most descriptors one message may carry.
pub const MAX_FDS: usize = 16;

fn sock() -> std::io::Result<OwnedFd> {
    Ok(socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// The server's listening socket. The socket file is removed on drop.
pub struct Listener {
    fd: OwnedFd,
    path: PathBuf,
}

impl Listener {
    /// Binds at `path`, replacing a stale socket file. The caller holds the
    /// server's start-up lock, so the file cannot belong to a live server.
    pub fn bind(path: &Path) -> std::io::Result<Listener> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let fd = sock()?;
        let addr = UnixAddr::new(path)?;
        socket::bind(fd.as_raw_fd(), &addr)?;
        socket::listen(&fd, Backlog::new(128).expect("valid backlog"))?;
        set_nonblocking(fd.as_fd())?;
        Ok(Listener {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// Accepts one pending connection, if any (non-blocking).
    pub fn accept(&self) -> std::io::Result<Option<Conn>> {
        match socket::accept4(self.fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            Ok(fd) => Ok(Some(Conn {
                // SAFETY: accept4 returned a fresh descriptor that we now own.
                fd: unsafe { OwnedFd::from_raw_fd(fd) },
            })),
            Err(nix::errno::Errno::EAGAIN) => Ok(None),
            Err(nix::errno::Errno::ECONNABORTED) | Err(nix::errno::Errno::EINTR) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let fl = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(fl | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Credentials of the peer process, from the kernel (not from the peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// One end of a bootstrap connection.
pub struct Conn {
    fd: OwnedFd,
}

impl Conn {
    /// Connects to the server socket at `path`.
    pub fn connect(path: &Path) -> std::io::Result<Conn> {
        let fd = sock()?;
        let addr = UnixAddr::new(path)?;
        socket::connect(fd.as_raw_fd(), &addr)?;
        Ok(Conn { fd })
    }

    /// The peer's pid/uid/gid as the kernel recorded them at connect time.
    pub fn peer_cred(&self) -> std::io::Result<PeerCred> {
        let c = socket::getsockopt(&self.fd, sockopt::PeerCredentials)?;
        Ok(PeerCred {
            pid: c.pid() as u32,
            uid: c.uid(),
            gid: c.gid(),
        })
    }

    /// Sends one message with optional descriptors.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let iov = [IoSlice::new(bytes)];
        let cmsg = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
        let n = socket::sendmsg::<()>(
            self.fd.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        if n != bytes.len() {
            return Err(std::io::Error::other("short send on a seqpacket socket"));
        }
        Ok(())
    }

    /// Receives one message into `buf`, waiting at most `timeout`. Returns
    /// the message length (0 = the peer closed the connection) and the
    /// descriptors it carried. A message longer than `buf` is an error.
    pub fn recv(
        &self,
        buf: &mut [u8],
        timeout: Duration,
    ) -> std::io::Result<(usize, Vec<OwnedFd>)> {
        if !self.wait_readable(timeout)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "bootstrap reply timed out",
            ));
        }
        let mut iov = [IoSliceMut::new(buf)];
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
        let msg = socket::recvmsg::<()>(
            self.fd.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
        )?;
        let mut fds = Vec::new();
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel installed these descriptors for us.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if msg.flags.contains(MsgFlags::MSG_TRUNC) || msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "bootstrap message truncated",
            ));
        }
        Ok((msg.bytes, fds))
    }

    fn wait_readable(&self, timeout: Duration) -> std::io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        loop {
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r >= 0 {
                return Ok(r > 0);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Whether the peer has closed its end (non-blocking). A message waiting
    /// to be read does not count as closed.
    pub fn peer_closed(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        r > 0 && (pfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR)) != 0
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_and_credentials_cross_the_socket() {
        let dir = std::env::temp_dir().join(format!("kvring-boot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.sock");
        let l = Listener::bind(&path).unwrap();
        let c = Conn::connect(&path).unwrap();
        let s = loop {
            if let Some(s) = l.accept().unwrap() {
                break s;
            }
        };
        let cred = s.peer_cred().unwrap();
        assert_eq!(cred.pid, std::process::id());
        assert_eq!(cred.uid, crate::rundir::euid());

        let memfd =
            nix::sys::memfd::memfd_create(c"kvring-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .unwrap();
        nix::unistd::write(&memfd, b"through the socket").unwrap();
        c.send(b"hello", &[memfd.as_fd()]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = s.recv(&mut buf, Duration::from_secs(1)).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        let mut got = [0u8; 18];
        nix::sys::uio::pread(&fds[0], &mut got, 0).unwrap();
        assert_eq!(&got, b"through the socket");

        assert!(!s.peer_closed());
        drop(c);
        assert!(s.peer_closed());
        let (n, _) = s.recv(&mut buf, Duration::from_secs(1)).unwrap();
        assert_eq!(n, 0, "EOF after the peer closed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
