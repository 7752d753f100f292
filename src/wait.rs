//! Waiting for a peer in another process: spin, then yield, then park on a
//! bell behind a "sleeping" count. A client parks on a shared futex word the
//! server writes; the server parks on its clients' doorbell pipes (a client can
//! write no word of the server's). Every wait has a deadline and re-checks
//! the peer's liveness each time it wakes.
//!
//! The parking protocol is io_uring's NEED_WAKEUP rule (a Dekker handshake):
//!
//! ```text
//! waiter                                   notifier
//! d = doorbell.load(Acquire)               publish the work (Release)
//! sleeping += 1                            fence(SeqCst)          -- F2
//! fence(SeqCst)                  -- F1     if sleeping.load() != 0:
//! if ready(): sleeping -= 1; return            doorbell += 1; FUTEX_WAKE
//! FUTEX_WAIT(doorbell, d, timeout)
//! sleeping -= 1
//! ```
//!
//! `sleeping` counts the parked waiters, so several threads of one process
//! may wait on one doorbell (handles of one client waited on from several
//! threads): one waking up does not hide the others from the notifier, and
//! a wake reaches them all.
//!
//! F1 and F2 order "sleeping = 1 then read the work" against "publish the
//! work then read sleeping": at least one side sees the other's store, so
//! either the waiter sees the work or the notifier sees the flag. If the
//! notifier's increment lands between the waiter's load of `d` and its
//! FUTEX_WAIT, the kernel sees `doorbell != d` and returns at once (a
//! pipe bell keeps a ring readable until the waiter drains it, which does
//! the same). When the waiter is not parked, the notifier pays one fence and
//! one load: no syscall.

use crate::futex;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a waiter spins and yields before it parks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-poll this long first (lowest latency, burns a core).
    pub spin: Duration,
    /// Then `sched_yield` this long.
    pub yield_for: Duration,
    /// Longest single futex sleep: liveness is re-checked at least this often.
    pub park_slice: Duration,
}

impl WaitPolicy {
    /// Spin only (until the deadline): both sides busy, no syscall at all.
    pub const SPIN: WaitPolicy = WaitPolicy {
        spin: Duration::MAX,
        yield_for: Duration::ZERO,
        park_slice: Duration::from_millis(50),
    };
    /// Park at once.
    pub const PARK: WaitPolicy = WaitPolicy {
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        park_slice: Duration::from_millis(50),
    };
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            spin: Duration::from_micros(20),
            yield_for: Duration::from_micros(200),
            park_slice: Duration::from_millis(50),
        }
    }
}

/// What a notifier rings to wake a parked waiter.
pub trait Ring {
    /// Wakes every waiter parked on it.
    fn ring(&self);
}

/// What a waiter parks on. A ring after [`Bell::arm`] returned must end the
/// next [`Bell::sleep`] given that call's mark (it may end for no reason).
pub trait Bell {
    /// What the waiter saw when it armed the bell.
    type Mark: Copy;
    /// Called before the waiter says it sleeps.
    fn arm(&self) -> Self::Mark;
    /// Sleeps at most `slice`, or until rung after the `arm` that gave `mark`.
    fn sleep(&self, mark: Self::Mark, slice: Duration);
}

/// A shared futex word: the notifier increments it and wakes its waiters;
/// the waiter sleeps while it still holds the value it saw when it armed.
impl Ring for AtomicU32 {
    fn ring(&self) {
        wake(self)
    }
}

impl Bell for AtomicU32 {
    type Mark = u32;

    fn arm(&self) -> u32 {
        // Acquire pairs with the notifier's Release increment in `wake`: a
        // value read here is at least as new as any wake we could have
        // missed.
        self.load(Ordering::Acquire)
    }

    fn sleep(&self, seen: u32, slice: Duration) {
        futex::wait(self, seen, slice);
    }
}

/// The "sleeping" count and the bell one side parks on. Clients park on a
/// futex word the server writes (`client_doorbell`); the server parks on the
/// clients' doorbell pipes (`crate::doorbell`).
pub struct Parking<'a, B: ?Sized = AtomicU32> {
    /// Written by the waiter only.
    pub sleeping: &'a AtomicU32,
    /// What the notifier rings.
    pub doorbell: &'a B,
}

impl<B: ?Sized> Clone for Parking<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for Parking<'_, B> {}

/// Why a wait ended without its condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd<E> {
    /// The deadline passed.
    Timeout,
    /// The liveness check failed with this error.
    Dead(E),
}

/// Waits until `ready` returns `Some`, the deadline passes, or `check_peer`
/// reports the peer gone. `check_peer` runs after every park slice and at
/// least every millisecond while spinning or yielding.
pub fn wait_until<T, E, B: Bell + ?Sized>(
    policy: &WaitPolicy,
    parking: Parking<'_, B>,
    deadline: Instant,
    mut ready: impl FnMut() -> Option<T>,
    mut check_peer: impl FnMut() -> Result<(), E>,
) -> Result<T, WaitEnd<E>> {
    if let Some(v) = ready() {
        return Ok(v);
    }
    let start = Instant::now();
    let mut last_check = start;
    let park_at_once = policy.spin.is_zero() && policy.yield_for.is_zero();
    // Spin, then yield; check the clock only every 64 rounds.
    let mut spinning = !park_at_once;
    while spinning {
        for _ in 0..64 {
            if let Some(v) = ready() {
                return Ok(v);
            }
            std::hint::spin_loop();
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitEnd::Timeout);
        }
        if now.duration_since(last_check) >= Duration::from_millis(1) {
            check_peer().map_err(WaitEnd::Dead)?;
            last_check = now;
        }
        let waited = now.duration_since(start);
        if waited < policy.spin {
            continue;
        }
        if waited < policy.spin.saturating_add(policy.yield_for) {
            std::thread::yield_now();
            continue;
        }
        spinning = false;
    }
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitEnd::Timeout);
        }
        let slice = (deadline - now).min(policy.park_slice);
        let seen = parking.doorbell.arm();
        // Relaxed: F1 orders it before the re-check below.
        parking.sleeping.fetch_add(1, Ordering::Relaxed);
        // F1 of the handshake above; pairs with the notifier's F2.
        fence(Ordering::SeqCst);
        if let Some(v) = ready() {
            parking.sleeping.fetch_sub(1, Ordering::Relaxed);
            return Ok(v);
        }
        parking.doorbell.sleep(seen, slice);
        parking.sleeping.fetch_sub(1, Ordering::Relaxed);
        if let Some(v) = ready() {
            return Ok(v);
        }
        check_peer().map_err(WaitEnd::Dead)?;
    }
}

/// The notifier's half: call after publishing work the waiter looks for.
/// Costs a fence and a load unless the waiter is parked.
#[inline]
pub fn notify<B: Ring + ?Sized>(parking: Parking<'_, B>) -> bool {
    // F2 of the handshake; pairs with the waiter's F1.
    fence(Ordering::SeqCst);
    if parking.sleeping.load(Ordering::Relaxed) != 0 {
        parking.doorbell.ring();
        true
    } else {
        false
    }
}

/// Rings a doorbell unconditionally.
pub fn wake(doorbell: &AtomicU32) {
    // Release pairs with the waiter's Acquire load of the doorbell.
    doorbell.fetch_add(1, Ordering::Release);
    futex::wake(doorbell, i32::MAX);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    struct Cell {
        sleeping: AtomicU32,
        doorbell: AtomicU32,
        flag: AtomicBool,
    }

    fn cell() -> Arc<Cell> {
        Arc::new(Cell {
            sleeping: AtomicU32::new(0),
            doorbell: AtomicU32::new(0),
            flag: AtomicBool::new(false),
        })
    }

    /// Two threads of one process park on one doorbell, each waiting for
    /// its own work (as two jobs of one client). The first finds its work
    /// ready just after announcing itself and leaves while the second is
    /// parked: that must not hide the second from the notifier, or the
    /// second sleeps its whole (here 10 s) slice.
    #[test]
    fn a_waiter_leaving_does_not_hide_another_from_the_notifier() {
        let policy = WaitPolicy {
            park_slice: Duration::from_secs(10),
            ..WaitPolicy::PARK
        };
        let c = cell();
        fn parking(c: &Cell) -> Parking<'_> {
            Parking {
                sleeping: &c.sleeping,
                doorbell: &c.doorbell,
            }
        }
        // B parks first.
        let b = {
            let c = c.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let r: Result<(), WaitEnd<()>> = wait_until(
                    &policy,
                    parking(&c),
                    Instant::now() + Duration::from_secs(20),
                    // Acquire pairs with the Release store of the flag below.
                    || c.flag.load(Ordering::Acquire).then_some(()),
                    || Ok(()),
                );
                assert!(r.is_ok());
                t.elapsed()
            })
        };
        let t = Instant::now();
        while c.sleeping.load(Ordering::Relaxed) == 0 {
            assert!(t.elapsed() < Duration::from_secs(5), "B never parked");
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(5));
        // A: its first check finds nothing; its check after announcing
        // itself finds its work, slowly, so it leaves after B is parked.
        let mut checks = 0;
        let r: Result<(), WaitEnd<()>> = wait_until(
            &policy,
            parking(&c),
            Instant::now() + Duration::from_secs(20),
            || {
                checks += 1;
                (checks > 1).then(|| std::thread::sleep(Duration::from_millis(20)))
            },
            || Ok(()),
        );
        assert!(r.is_ok());
        // B's work, then the notifier's half.
        c.flag.store(true, Ordering::Release);
        notify(parking(&c));
        let waited = b.join().unwrap();
        assert!(waited < Duration::from_secs(2), "B slept {waited:?}");
    }

    #[test]
    fn parked_waiter_is_woken_by_notify() {
        let c = cell();
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            // Release pairs with the waiter's Acquire load of the flag.
            c2.flag.store(true, Ordering::Release);
            notify(Parking {
                sleeping: &c2.sleeping,
                doorbell: &c2.doorbell,
            })
        });
        let start = Instant::now();
        let r: Result<(), WaitEnd<()>> = wait_until(
            &WaitPolicy::PARK,
            Parking {
                sleeping: &c.sleeping,
                doorbell: &c.doorbell,
            },
            Instant::now() + Duration::from_secs(5),
            // Acquire pairs with the notifier's Release store of the flag.
            || c.flag.load(Ordering::Acquire).then_some(()),
            || Ok(()),
        );
        assert!(r.is_ok());
        assert!(
            t.join().unwrap(),
            "the waiter was parked, so notify had to wake it"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wait_ends_at_its_deadline() {
        let c = cell();
        let start = Instant::now();
        let r: Result<(), WaitEnd<()>> = wait_until(
            &WaitPolicy::default(),
            Parking {
                sleeping: &c.sleeping,
                doorbell: &c.doorbell,
            },
            Instant::now() + Duration::from_millis(120),
            || None,
            || Ok(()),
        );
        assert_eq!(r, Err(WaitEnd::Timeout));
        let e = start.elapsed();
        assert!(
            e >= Duration::from_millis(120) && e < Duration::from_secs(2),
            "{e:?}"
        );
    }

    #[test]
    fn dead_peer_ends_the_wait() {
        let c = cell();
        let mut calls = 0;
        let r: Result<(), WaitEnd<&str>> = wait_until(
            &WaitPolicy::PARK,
            Parking {
                sleeping: &c.sleeping,
                doorbell: &c.doorbell,
            },
            Instant::now() + Duration::from_secs(30),
            || None,
            || {
                calls += 1;
                if calls > 2 {
                    Err("gone")
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(r, Err(WaitEnd::Dead("gone")));
    }

    #[test]
    fn notify_without_sleeper_makes_no_wake() {
        let c = cell();
        assert!(!notify(Parking {
            sleeping: &c.sleeping,
            doorbell: &c.doorbell
        }));
        assert_eq!(c.doorbell.load(Ordering::Relaxed), 0);
    }
}
