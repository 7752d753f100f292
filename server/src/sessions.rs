//! The client sessions as the server's two threads share them. The
//! acceptor attaches and reclaims slots and the ring loop serves them; they
//! tell each other through this link (attach and detach events one way,
//! kicks and detached slots the other, each rung on the receiver's
//! doorbell), and it holds each attached slot's session memory, which an
//! ended job reaches to wake its parked owner.

use kvring::client_memory::OwnedClientMemory;
use kvring::doorbell::{Doorbell, DoorbellReceiver};
use kvring::segment::Mapping;
use kvring::shm::DisconnectReason;
use kvring::wait::Parking;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Acceptor -> ring loop.
pub(crate) enum RingEvent {
    Attach {
        slot: u32,
        session: u32,
        /// The client's engine key (from its hello).
        engine: [u8; 32],
        /// The session's memory (its block and request ring).
        memory: Arc<OwnedClientMemory>,
        /// The server's end of the client's doorbell.
        doorbell: DoorbellReceiver,
    },
    Detach {
        slot: u32,
    },
}

pub(crate) struct Sessions {
    /// Acceptor -> ring loop.
    events: Mutex<Vec<RingEvent>>,
    events_pending: AtomicBool,
    /// Ring loop -> acceptor: slots whose client broke its ring.
    kicks: Mutex<Vec<(u32, DisconnectReason)>>,
    /// Ring loop -> acceptor: detached slots.
    detached: Mutex<Vec<u32>>,
    /// Wakes the acceptor (rung with a kick or a detached slot, so that a
    /// slot is reclaimed at once, not at the acceptor's next tick).
    acceptor_bell: Doorbell,
    /// The ring loop's own doorbell: the other threads wake it with this.
    ring_bell: Doorbell,
    /// Each slot's session memory while it is attached (the acceptor sets
    /// and clears it; `wake_client` reads its `client_sleeping`). The last
    /// holder to let go closes and unmaps it.
    memory: Vec<RwLock<Option<Arc<OwnedClientMemory>>>>,
}

impl Sessions {
    /// `max_clients` slots; `ring_bell` wakes the ring loop and
    /// `acceptor_bell` the acceptor.
    pub(crate) fn new(max_clients: u32, ring_bell: Doorbell, acceptor_bell: Doorbell) -> Sessions {
        Sessions {
            events: Mutex::new(Vec::new()),
            events_pending: AtomicBool::new(false),
            kicks: Mutex::new(Vec::new()),
            detached: Mutex::new(Vec::new()),
            acceptor_bell,
            ring_bell,
            memory: (0..max_clients).map(|_| RwLock::new(None)).collect(),
        }
    }

    /// Acceptor -> ring loop, which is woken.
    pub(crate) fn push_event(&self, ev: RingEvent) {
        self.events.lock().expect("events lock").push(ev);
        // Release pairs with the ring loop's Acquire swap in `take_events`.
        self.events_pending.store(true, Ordering::Release);
        self.wake_ring_loop();
    }

    /// The ring loop takes the events pushed since it last looked.
    pub(crate) fn take_events(&self) -> Vec<RingEvent> {
        // Acquire pairs with the Release store in `push_event`.
        if !self.events_pending.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.events.lock().expect("events lock"))
    }

    /// Whether events wait to be taken (the ring loop's wake-up check).
    pub(crate) fn has_events(&self) -> bool {
        // Acquire pairs with the Release store in `push_event`.
        self.events_pending.load(Ordering::Acquire)
    }

    pub(crate) fn wake_ring_loop(&self) {
        self.ring_bell.ring();
    }

    /// Ring loop -> acceptor: disconnect `slot`'s client.
    pub(crate) fn kick(&self, slot: u32, reason: DisconnectReason) {
        self.kicks.lock().expect("kicks").push((slot, reason));
        self.acceptor_bell.ring();
    }

    /// Ring loop -> acceptor: `slot` is detached, reclaim it.
    pub(crate) fn detached(&self, slot: u32) {
        self.detached.lock().expect("detached").push(slot);
        self.acceptor_bell.ring();
    }

    /// The acceptor takes the kicks, then the detached slots.
    pub(crate) fn take_kicks(&self) -> (Vec<(u32, DisconnectReason)>, Vec<u32>) {
        let kicks = std::mem::take(&mut *self.kicks.lock().expect("kicks"));
        let detached = std::mem::take(&mut *self.detached.lock().expect("detached"));
        (kicks, detached)
    }

    /// The acceptor attached a session at `slot`.
    pub(crate) fn attach_memory(&self, slot: u32, memory: Arc<OwnedClientMemory>) {
        *self.memory[slot as usize]
            .write()
            .expect("client memory table") = Some(memory);
    }

    /// The acceptor reclaimed `slot`: its memory goes (closed and unmapped
    /// with its last holder); a process still writing to it reaches nobody.
    pub(crate) fn release_memory(&self, slot: u32) {
        self.memory[slot as usize]
            .write()
            .expect("client memory table")
            .take();
    }

    /// The memory of the session attached at `slot`, if one is.
    pub(crate) fn memory_of(&self, slot: u32) -> Option<Arc<OwnedClientMemory>> {
        self.memory
            .get(slot as usize)?
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Wakes client `slot` if it is parked (a job of its ended); `seg` is
    /// the server's segment, which holds the client's doorbell.
    pub(crate) fn wake_client(&self, slot: u32, seg: &Mapping) {
        let memory = self.memory[slot as usize]
            .read()
            .expect("client memory table");
        let Some(memory) = memory.as_ref() else {
            // Detached: nobody of this session waits any more.
            return;
        };
        kvring::wait::notify(Parking {
            sleeping: &memory.memory().block().client_sleeping,
            doorbell: &*seg.server_client(slot).client_doorbell,
        });
    }
}
