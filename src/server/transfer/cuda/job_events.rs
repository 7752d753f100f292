//! Job events: per client and device, interprocess events the server
//! records, in turn, on one in-order gate stream after all of a job's chunk
//! copies, so an engine's stream can wait for a job on the device.

use crate::gpu::{Context, CudaError, Event, EventKind, Stream};
use crate::server::transfer::backend::Publish;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// One client's job events on one device.
pub(super) struct JobEvents {
    /// Drained and destroyed first (declaration order), so no record is
    /// pending when the events go.
    gate: Stream,
    events: Vec<Event>,
    handles: Vec<[u8; 64]>,
    next: AtomicU32,
}

impl JobEvents {
    pub(super) fn new(ctx: &Arc<Context>) -> Result<JobEvents, CudaError> {
        let gate = Stream::new(ctx)?;
        let mut events = Vec::with_capacity(crate::proto::kv::JOB_EVENTS);
        let mut handles = Vec::with_capacity(crate::proto::kv::JOB_EVENTS);
        for _ in 0..crate::proto::kv::JOB_EVENTS {
            let ev = Event::new(ctx, EventKind::Interprocess)?;
            handles.push(ev.ipc_handle()?.to_bytes());
            // Recorded once, so a wait on it before its first job use does
            // not wait forever.
            ev.record(&gate)?;
            events.push(ev);
        }
        Ok(JobEvents {
            gate,
            events,
            handles,
            next: AtomicU32::new(0),
        })
    }

    /// The handles engines open the events with.
    pub(super) fn handles(&self) -> &[[u8; 64]] {
        &self.handles
    }

    /// Orders the gate after `chunk_done` (one chunk's copy, just queued);
    /// the job's last chunk queued then records the next job event after
    /// all of them and publishes its index + 1 as the job's progress.
    pub(super) fn publish_after(
        &self,
        chunk_done: &Event,
        p: &Publish<'_>,
    ) -> Result<(), CudaError> {
        // The gate waits for this chunk now (capturing this record).
        self.gate.wait_event(chunk_done)?;
        // AcqRel: every other chunk's gate wait happens before the last
        // decrement (its Release half), and the last one's Acquire half
        // orders the record below after all of them.
        if p.chunks_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Relaxed: only picks the event; the gate stream orders the
            // records themselves.
            let k = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.events.len();
            self.events[k].record(&self.gate)?;
            (p.publish_progress)(k as u64 + 1);
        }
        Ok(())
    }
}
