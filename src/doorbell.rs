//! How a client wakes the server's ring loop: a doorbell of its own.
//!
//! Each client session has a doorbell, a pipe the server creates at the
//! hello: the client gets the writing end ([`Doorbell`]) and rings it (one
//! byte) after publishing a request when the ring loop says it sleeps; the
//! server keeps the reading end ([`DoorbellReceiver`]). The ring loop waits
//! on every receiver at once through [`Doorbells`], an epoll set the server
//! alone holds. A doorbell is not shared memory, and the client holds
//! nothing of the reading end: whatever it writes only wakes the loop for
//! nothing, and it can neither drain the pipe nor make the server's reads
//! block (those are flags of the server's own open file description).

use crate::error::{nix as nix_err, Result};
use crate::wait::{Bell, Ring};
use nix::fcntl::OFlag;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

/// The ringing end of a doorbell.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

/// The server's end of a doorbell: readable once rung, until drained.
#[derive(Debug)]
pub struct DoorbellReceiver {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new doorbell: its ringing end and its receiver (both non-blocking,
    /// close-on-exec).
    pub fn pair() -> Result<(Doorbell, DoorbellReceiver)> {
        let (rx, tx) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)
            .map_err(nix_err("pipe2"))?;
        Ok((Doorbell { fd: tx }, DoorbellReceiver { fd: rx }))
    }

    /// The ringing end a client received from the server.
    pub(crate) fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell { fd }
    }

    /// Rings it: one byte. A full pipe (`EAGAIN`) is readable already, so
    /// the ring is not lost.
    pub fn ring(&self) {
        let _ = nix::unistd::write(&self.fd, &[1u8]);
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A client rings the server with its own doorbell.
impl Ring for Doorbell {
    fn ring(&self) {
        Doorbell::ring(self)
    }
}

impl DoorbellReceiver {
    /// Reads what was rung, at most 16 KiB per call (never blocks: the
    /// server's end is non-blocking and nobody else holds it). A client
    /// that writes faster than that cannot keep the loop here: what is left
    /// stays readable and wakes the next wait, which also serves the rings.
    pub fn drain(&self) {
        let mut buf = [0u8; 4096];
        for _ in 0..4 {
            match nix::unistd::read(&self.fd, &mut buf) {
                Ok(n) if n == buf.len() => continue,
                _ => break,
            }
        }
    }
}

impl AsFd for DoorbellReceiver {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The set of doorbells the ring loop waits on: the server's own (rung by
/// its other threads) and one per attached client, whose receivers the set
/// owns from the client's attach to its detach. Only the ring loop uses it.
pub struct Doorbells {
    epoll: Epoll,
    own: DoorbellReceiver,
    clients: Vec<Option<DoorbellReceiver>>,
}

/// Token of the server's own doorbell in the epoll set (clients use their
/// slot number, below `MAX_CLIENTS`).
const OWN: u64 = u64::MAX;

impl Doorbells {
    /// A set holding the server's own receiver `own` and room for
    /// `max_clients` clients.
    pub fn new(own: DoorbellReceiver, max_clients: u32) -> Result<Doorbells> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(nix_err("epoll_create"))?;
        epoll
            .add(&own, EpollEvent::new(EpollFlags::EPOLLIN, OWN))
            .map_err(nix_err("epoll_ctl add"))?;
        Ok(Doorbells {
            epoll,
            own,
            clients: (0..max_clients).map(|_| None).collect(),
        })
    }

    /// Adds client `slot`'s receiver (replacing, and closing, an earlier one).
    pub fn add(&mut self, slot: u32, bell: DoorbellReceiver) -> Result<()> {
        self.remove(slot);
        self.epoll
            .add(&bell, EpollEvent::new(EpollFlags::EPOLLIN, u64::from(slot)))
            .map_err(nix_err("epoll_ctl add"))?;
        self.clients[slot as usize] = Some(bell);
        Ok(())
    }

    /// Removes and closes client `slot`'s receiver.
    pub fn remove(&mut self, slot: u32) {
        if let Some(bell) = self.clients[slot as usize].take() {
            let _ = self.epoll.delete(&bell);
        }
    }
}

/// The ring loop parks on every doorbell at once.
///
/// `arm` does nothing: a doorbell rung at any time before the sleep stays
/// readable until drained (level-triggered), and the loop drains only what
/// a wait reported, after it returned, and then re-checks every ring
/// (`wait::wait_until`). A ring that lands between the wake and the drain is
/// eaten, but the work it announced was published before it and is seen by
/// that re-check. A client that closes its end makes its receiver report
/// hang-up: the receiver leaves the epoll set at once.
impl Bell for Doorbells {
    type Mark = ();

    fn arm(&self) {}

    fn sleep(&self, _mark: (), slice: Duration) {
        // Whole milliseconds, rounded up: a sub-millisecond slice must not
        // become a busy poll.
        let ms = slice.as_micros().div_ceil(1000).clamp(1, u128::from(u16::MAX)) as u16;
        let mut events = [EpollEvent::empty(); 64];
        let Ok(n) = self.epoll.wait(&mut events, EpollTimeout::from(ms)) else {
            // EINTR: a spurious wake, which the caller handles.
            return;
        };
        for e in &events[..n] {
            if e.data() == OWN {
                self.own.drain();
            } else if let Some(Some(bell)) = self.clients.get(e.data() as usize) {
                bell.drain();
                if e.events().intersects(EpollFlags::EPOLLHUP | EpollFlags::EPOLLERR) {
                    // The client closed its end: it cannot ring any more, and
                    // a hung-up pipe would wake this loop without end. Its
                    // ring is still served, on any other wake and at least
                    // every park slice, until its slot is detached.
                    let _ = self.epoll.delete(bell);
                }
            }
        }
    }
}
