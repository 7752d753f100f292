//! The endpoint's open connections, bounded: a new one makes room by
//! closing the oldest that waits on its client.

use super::lock;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// The open connections: their number, and the ones waiting on their
/// client (reading the request, writing the answer), oldest first, which
/// may be closed to make room.
pub(super) struct Slots {
    max: usize,
    open: usize,
    next: u64,
    waiting: BTreeMap<u64, Arc<Notify>>,
}

/// One open connection's place.
pub(super) struct Slot {
    id: u64,
    slots: Arc<Mutex<Slots>>,
    closed: Arc<Notify>,
    /// In `waiting`, or closed to make room (and counted out then); false
    /// while it is being answered.
    waiting: bool,
}

impl Slots {
    /// No connection open yet, at most `max`.
    pub(super) fn new(max: usize) -> Arc<Mutex<Slots>> {
        Arc::new(Mutex::new(Slots {
            max,
            open: 0,
            next: 0,
            waiting: BTreeMap::new(),
        }))
    }

    /// Closes the oldest connection waiting on its client (its task
    /// answers 503 and ends when it runs next); false if none is.
    pub(super) fn close_oldest(&mut self) -> bool {
        match self.waiting.pop_first() {
            Some((_, closed)) => {
                // Stores a permit when the task is not waiting on it: it
                // sees it at its next wait.
                closed.notify_one();
                self.open -= 1;
                true
            }
            None => false,
        }
    }

    /// A place for a new connection (waiting on its client), making room
    /// if the bound is reached; none when every connection is being
    /// answered.
    pub(super) fn admit(slots: &Arc<Mutex<Slots>>) -> Option<Slot> {
        let mut s = lock(slots);
        if s.open >= s.max && !s.close_oldest() {
            return None;
        }
        s.open += 1;
        let id = s.next;
        s.next += 1;
        let closed = Arc::new(Notify::new());
        s.waiting.insert(id, closed.clone());
        Some(Slot {
            id,
            slots: slots.clone(),
            closed,
            waiting: true,
        })
    }
}

impl Slot {
    /// Ends when this connection is closed to make room.
    pub(super) async fn closed_for_room(&self) {
        self.closed.notified().await
    }

    /// Being answered: not closed to make room meanwhile. False if it was
    /// closed already (and counted out then).
    pub(super) fn hold(&mut self) -> bool {
        let held = lock(&self.slots).waiting.remove(&self.id).is_some();
        if held {
            self.waiting = false;
        }
        held
    }

    /// Waiting on the client again (its answer being written).
    pub(super) fn release(&mut self) {
        lock(&self.slots)
            .waiting
            .insert(self.id, self.closed.clone());
        self.waiting = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = lock(&self.slots);
        // A connection closed to make room was counted out then.
        if !self.waiting || s.waiting.remove(&self.id).is_some() {
            s.open -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_endpoint_closes_its_oldest_waiting_connection_and_counts_each_once() {
        let s = Slots::new(2);
        let open = || lock(&s).open;
        let mut a = Slots::admit(&s).unwrap();
        let mut b = Slots::admit(&s).unwrap();
        // Both being answered: no room.
        assert!(a.hold() && b.hold());
        assert!(Slots::admit(&s).is_none());
        // `a` writes its answer: it is the one closed for the next.
        a.release();
        let mut c = Slots::admit(&s).unwrap();
        assert_eq!(open(), 2);
        // Its end counts nothing again; `b`'s does.
        drop(a);
        assert_eq!(open(), 2);
        drop(b);
        assert_eq!(open(), 1);
        // `c`, still reading its request, is the oldest waiting: closed for
        // `e`, it cannot be held for an answer, and its end counts nothing.
        let mut d = Slots::admit(&s).unwrap();
        let e = Slots::admit(&s).unwrap();
        assert!(!c.hold());
        drop(c);
        assert_eq!(open(), 2);
        assert!(d.hold());
        drop(d);
        drop(e);
        assert_eq!(open(), 0);
        assert!(lock(&s).waiting.is_empty());
    }
}
