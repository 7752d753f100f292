//! How a client wakes the server's ring loop: a doorbell of its own.
//!
//! Each client session has a [`Doorbell`], an eventfd the server creates at
//! the hello and hands to the client next to its memory; the client rings it
//! (writes 1) after publishing a request when the ring loop says it sleeps.
//! The ring loop waits on all of them at once through [`Doorbells`], an
//! epoll set the server alone holds. A doorbell is not shared memory: a
//! client that writes garbage to its own eventfd, or drains it, only wakes
//! the loop for nothing or delays its own requests, never another
//! client's, and no client can write a word the server parks on.

use crate::error::{nix as nix_err, Result};
use crate::wait::{Bell, Ring};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

/// One eventfd: rung by its client (or by the server itself), waited on by
/// the ring loop.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new doorbell (non-blocking, close-on-exec).
    pub fn new() -> Result<Doorbell> {
        let bell = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(nix_err("eventfd"))?;
        Ok(Doorbell {
            fd: OwnedFd::from(bell),
        })
    }

    /// The doorbell a client received from the server. The server created
    /// it non-blocking, a property of the open description both share.
    pub(crate) fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell { fd }
    }

    /// Rings it: one `write` of 1. A full counter (`EAGAIN`) is already
    /// readable, so the ring is not lost.
    pub fn ring(&self) {
        let _ = nix::unistd::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Resets the counter (one `read`; nothing to read is fine).
    fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = nix::unistd::read(&self.fd, &mut buf);
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

/// The set of doorbells the ring loop waits on: the server's own (rung by
/// its other threads) and one per attached client, which the set owns from
/// the client's attach to its detach. Only the ring loop uses it.
pub struct Doorbells {
    epoll: Epoll,
    /// A second descriptor of the server's own doorbell, to drain it.
    own: Doorbell,
    clients: Vec<Option<Doorbell>>,
}

/// Token of the server's own doorbell in the epoll set (clients use their
/// slot number, below `MAX_CLIENTS`).
const OWN: u64 = u64::MAX;

impl Doorbells {
    /// A set holding `own` and room for `max_clients` clients.
    pub fn new(own: &Doorbell, max_clients: u32) -> Result<Doorbells> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(nix_err("epoll_create"))?;
        let own = Doorbell {
            fd: own
                .fd
                .try_clone()
                .map_err(crate::error::io("dup the server's doorbell"))?,
        };
        epoll
            .add(&own, EpollEvent::new(EpollFlags::EPOLLIN, OWN))
            .map_err(nix_err("epoll_ctl add"))?;
        Ok(Doorbells {
            epoll,
            own,
            clients: (0..max_clients).map(|_| None).collect(),
        })
    }

    /// Adds client `slot`'s doorbell (replacing, and closing, an earlier one).
    pub fn add(&mut self, slot: u32, bell: Doorbell) -> Result<()> {
        self.remove(slot);
        self.epoll
            .add(&bell, EpollEvent::new(EpollFlags::EPOLLIN, u64::from(slot)))
            .map_err(nix_err("epoll_ctl add"))?;
        self.clients[slot as usize] = Some(bell);
        Ok(())
    }

    /// Removes and closes client `slot`'s doorbell.
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
/// that re-check.
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
            }
        }
    }

}

impl Ring for Doorbells {
    fn ring(&self) {
        self.own.ring()
    }
}
