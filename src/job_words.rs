//! Job words: per STORE or RETRIEVE in flight, a few words in its client's
//! own memory ([`crate::client_memory`]) that order the engine's GPU work
//! after the server's copies and let the client give a job up safely,
//! whatever the server does or fails to do.
//!
//! The client picks a free entry and a new generation `g` for each job and
//! sends both with the request. In entry `e`:
//!
//! * `go`: the server stores `g` once every copy of the job is over (done,
//!   failed or skipped; not while a copy may still run on the device); an
//!   engine's stream waits on the device until `go` has reached `g`
//!   (`cuStreamWaitValue32`, a cyclic `>=`). The client stores `g` itself
//!   when it gives the job up, so no stream waits for a server that died or
//!   stopped. `go` only moves forward.
//! * `landed`: for a RETRIEVE in `G` layer groups (the layers split in `G`
//!   ranges, copied group after group), the server stores `g - G + k` once
//!   the copies of the first `k` groups are over, so an engine's stream
//!   can wait for the layers its next kernel reads (`>= g - G + k + 1`
//!   before group `k`) while later groups still land. The client takes
//!   the `G` generations `g - G + 1 ..= g` for such a job (so no older
//!   value reads as reached), and `landed` ends at `g` with `go`: the
//!   server's release and the client's give-up store both.
//! * `cancel`: the client stores `g` to give the job up. The server reads it
//!   before each chunk copy, and the copy kernel reads it again on the
//!   device before it touches the engine's memory; a store whose job was
//!   given up never commits.
//! * `entered[w]` / `done[w]`, per copy worker `w` of the job's lane: the
//!   copy of a chunk stores its own sequence number into `entered[w]` before
//!   it reads `cancel` (the kernel on the device, or the worker thread for a
//!   host copy), and `done[w]` is set to it once the copy can no longer
//!   touch the engine's memory (the copy stream writes it after the kernel).
//!   A client that stored `cancel` and then finds `entered == done` for
//!   every worker knows no copy of the job is running and none will start
//!   (each copy stores `entered` before it loads `cancel`, the client stores
//!   `cancel` before it loads `entered`: one of them sees the other).
//!
//! All three kinds of words are written by another process: every value
//! read here is untrusted. A client that scribbles on its own words can
//! only cancel its own jobs or release its own streams early.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

/// Entries per client session: at most this many of a client's STORE and
/// RETRIEVE jobs are in flight at once.
pub const JOB_WORDS: u32 = 512;
/// Copy workers per lane that entries have words for (the bound of
/// `--copy-threads`).
pub const WORD_WORKERS: u32 = 32;
/// Bytes per entry.
pub const ENTRY_BYTES: usize = 384;
/// Bytes of a session's job words region (page-aligned, at
/// `Offsets::job_words_off` in its client memory).
pub const REGION_BYTES: usize = JOB_WORDS as usize * ENTRY_BYTES;

/// Offsets of the words in an entry.
pub const GO: usize = 0;
pub const CANCEL: usize = 4;
pub const LANDED: usize = 8;
pub const ENTERED: usize = 16;
pub const DONE: usize = ENTERED + 4 * WORD_WORKERS as usize;
const _: () = assert!(DONE + 4 * WORD_WORKERS as usize <= ENTRY_BYTES);
const _: () = assert!(REGION_BYTES % crate::shm::PAGE == 0);

/// Whether `value` has reached `target`, cyclically (as the device's
/// `cuStreamWaitValue32` with `GEQ` compares): generations may wrap.
pub fn reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Moves `word` forward to `value` (cyclically; never back). The exchange
/// is tried a bounded number of times: the other side changes the word at
/// most once per generation or layer group, so only a party scribbling on
/// it (a client on its own words) keeps it failing, and the server must not
/// spin on memory a client writes.
fn forward(word: &AtomicU32, value: u32, name: &str) {
    const TRIES: usize = 16;
    // Relaxed: only the value decides; the successful exchange is the
    // release.
    let mut cur = word.load(Ordering::Relaxed);
    for _ in 0..TRIES {
        if reached(cur, value) {
            return;
        }
        // Release (success): whatever the releasing side did before (the
        // server's copies, settled; the client's give-up) happens before a
        // host reader's Acquire load of the word (`released`, `landed_at`;
        // a stream reads it on the device). Relaxed (failure): retried with
        // the value seen.
        match word.compare_exchange_weak(cur, value, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
    tracing::warn!(word = name, "a job word kept changing under a store; left as it is");
}

/// One session's job words as mapped in this process (borrowed from the
/// mapping that owns them).
#[derive(Clone, Copy)]
pub struct Words<'a> {
    base: *mut u8,
    _mapping: PhantomData<&'a ()>,
}

// SAFETY: only atomics are formed over the region.
unsafe impl Send for Words<'_> {}
// SAFETY: as above.
unsafe impl Sync for Words<'_> {}

impl<'a> Words<'a> {
    /// # Safety
    /// `base` is the page-aligned start of [`REGION_BYTES`] bytes of shared
    /// memory, mapped readable and writable for `'a`.
    pub unsafe fn new(base: *mut u8) -> Words<'a> {
        Words {
            base,
            _mapping: PhantomData,
        }
    }

    /// Byte offset of word `off` of entry `entry` in the region.
    pub fn offset(entry: u32, off: usize) -> usize {
        assert!(entry < JOB_WORDS, "job word entry {entry} out of range");
        entry as usize * ENTRY_BYTES + off
    }

    fn at(&self, entry: u32, off: usize) -> &'a AtomicU32 {
        // SAFETY: the offset is inside the region (`offset` checks the
        // entry; every `off` here is below ENTRY_BYTES) and 4-aligned; the
        // region is mapped for 'a (`new`'s contract), and AtomicU32 is valid
        // for any bits and sound to share with another process.
        unsafe { &*(self.base.add(Self::offset(entry, off)) as *const AtomicU32) }
    }

    pub fn go(&self, entry: u32) -> &'a AtomicU32 {
        self.at(entry, GO)
    }

    pub fn cancel(&self, entry: u32) -> &'a AtomicU32 {
        self.at(entry, CANCEL)
    }

    pub fn landed(&self, entry: u32) -> &'a AtomicU32 {
        self.at(entry, LANDED)
    }

    pub fn entered(&self, entry: u32, worker: u32) -> &'a AtomicU32 {
        assert!(worker < WORD_WORKERS);
        self.at(entry, ENTERED + 4 * worker as usize)
    }

    pub fn done(&self, entry: u32, worker: u32) -> &'a AtomicU32 {
        assert!(worker < WORD_WORKERS);
        self.at(entry, DONE + 4 * worker as usize)
    }

    /// Whether generation `g` of `entry` was given up.
    pub fn cancelled(&self, entry: u32, g: u32) -> bool {
        // SeqCst: the load half of the copy's Dekker pair (`enter`): after
        // its SeqCst store of `entered`.
        reached(self.cancel(entry).load(Ordering::SeqCst), g)
    }

    /// A host copy of generation `g` starts as sequence `seq` of `worker`:
    /// false if the job was given up (then nothing may be copied; `leave`
    /// still follows).
    pub fn enter(&self, entry: u32, g: u32, worker: u32, seq: u32) -> bool {
        // SeqCst: pairs with the client's SeqCst store of `cancel` and load
        // of `entered` in `quiescent` (store then load on both sides: at
        // least one sees the other's store).
        self.entered(entry, worker).store(seq, Ordering::SeqCst);
        !self.cancelled(entry, g)
    }

    /// The host copy `seq` of `worker` no longer touches the engine's
    /// memory.
    pub fn leave(&self, entry: u32, worker: u32, seq: u32) {
        // Release: the copy's accesses happen before a client that reads
        // this value (Acquire, in `quiescent`) reuses the memory.
        self.done(entry, worker).store(seq, Ordering::Release);
    }

    /// The client gives generation `g` of `entry` up: no copy starts after
    /// this returns.
    pub fn give_up(&self, entry: u32, g: u32) {
        // SeqCst: pairs with the copies' SeqCst `entered` store and
        // `cancel` load (`enter`, and the kernel's system-scope fence).
        self.cancel(entry).store(g, Ordering::SeqCst);
    }

    /// No copy of `entry` is under way: every worker's last copy that
    /// entered is done (after `give_up`: and none will enter and copy).
    pub fn quiescent(&self, entry: u32) -> bool {
        (0..WORD_WORKERS).all(|w| {
            // SeqCst: the load half of `give_up`'s Dekker pair.
            let e = self.entered(entry, w).load(Ordering::SeqCst);
            // Acquire: pairs with `leave` (or the device's write after the
            // kernel).
            e == self.done(entry, w).load(Ordering::Acquire)
        })
    }

    /// Releases the streams waiting for generation `g` of `entry` (its
    /// `go`, and its `landed` with it): both only move forward
    /// (cyclically), so a late or repeated release of an older generation
    /// never takes a newer one back.
    pub fn release(&self, entry: u32, g: u32) {
        // `landed` first: a reader that sees `go` reached finds every
        // layer group landed too.
        forward(self.landed(entry), g, "landed");
        forward(self.go(entry), g, "go");
    }

    /// The first layer groups of generation `g` of `entry`, which has
    /// `groups` of them, landed up to `value` (`g - groups + k` after `k`
    /// groups): streams waiting for those groups go on.
    pub fn land(&self, entry: u32, value: u32) {
        forward(self.landed(entry), value, "landed");
    }

    /// Makes `entry` ready for generation `g` of a job in `groups` layer
    /// groups (1 for any other job), whose predecessor in the entry ended
    /// (released, no copy under way): `go` and `cancel` one behind `g` and
    /// `landed` at `g - groups`, so none reads as reached for the job
    /// however long the entry was idle (the predecessor's generation is at
    /// most `g - groups`).
    /// Its `entered` and `done` words go back to 0 (copy numbers are never
    /// 0): a copy of the new generation always changes `entered`, even one
    /// by a worker of another lane whose count happens to match.
    pub fn reset(&self, entry: u32, g: u32, groups: u32) {
        // Relaxed: nothing of generation `g` runs yet (the request that
        // names it is sent after this, a Release on the ring); a stream of
        // an older generation reads a value at or past its own.
        self.go(entry).store(g.wrapping_sub(1), Ordering::Relaxed);
        self.cancel(entry).store(g.wrapping_sub(1), Ordering::Relaxed);
        self.landed(entry)
            .store(g.wrapping_sub(groups.max(1)), Ordering::Relaxed);
        for w in 0..WORD_WORKERS {
            // Relaxed: as above; no copy of the entry's last job is under
            // way (the entry is reused only then).
            self.entered(entry, w).store(0, Ordering::Relaxed);
            self.done(entry, w).store(0, Ordering::Relaxed);
        }
    }

    /// Whether `landed` of `entry` has reached `value`.
    pub fn landed_at(&self, entry: u32, value: u32) -> bool {
        // Acquire: pairs with the Release exchange in `forward` (`land`,
        // `release`): the group's copies happen before.
        reached(self.landed(entry).load(Ordering::Acquire), value)
    }

    /// Whether generation `g` of `entry` was released.
    pub fn released(&self, entry: u32, g: u32) -> bool {
        // Acquire: pairs with `release`.
        reached(self.go(entry).load(Ordering::Acquire), g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_compare_cyclically() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(2, u32::MAX - 1));
        assert!(!reached(u32::MAX - 1, 2));
    }

    #[test]
    fn a_given_up_job_is_quiescent_only_once_its_entered_copies_are_done() {
        let mut region = vec![0u32; REGION_BYTES / 4];
        // SAFETY: a live, writable, 4-aligned buffer of REGION_BYTES bytes.
        let w = unsafe { Words::new(region.as_mut_ptr() as *mut u8) };
        let (e, g) = (7, 3);
        assert!(w.enter(e, g, 2, 11));
        assert!(!w.quiescent(e));
        w.give_up(e, g);
        assert!(!w.quiescent(e));
        w.leave(e, 2, 11);
        assert!(w.quiescent(e));
        // A copy that enters after the give-up copies nothing.
        assert!(!w.enter(e, g, 3, 12));
        w.leave(e, 3, 12);
        assert!(w.quiescent(e));
        // The next generation of the entry is not cancelled.
        assert!(!w.cancelled(e, g + 1));
        assert!(!w.released(e, g));
        w.release(e, g);
        assert!(w.released(e, g) && !w.released(e, g + 1));
        // A late release of an older generation changes nothing.
        w.release(e, g + 5);
        w.release(e, g);
        assert!(w.released(e, g + 5));
        // Reset for a generation far ahead: neither cancelled nor released.
        let far = g.wrapping_add(3 << 30);
        w.reset(e, far, 1);
        assert!(!w.cancelled(e, far) && !w.released(e, far));
        // A copy of the new generation numbered as the last one is seen.
        assert!(w.enter(e, far, 2, 11));
        w.give_up(e, far);
        assert!(!w.quiescent(e));
    }

    #[test]
    fn layer_groups_land_in_order_and_end_with_go() {
        let mut region = vec![0u64; REGION_BYTES / 8];
        // SAFETY: the region is REGION_BYTES long, 8-aligned and lives for
        // the test.
        let w = unsafe { Words::new(region.as_mut_ptr() as *mut u8) };
        let (e, groups) = (7, 4u32);
        // The last job of the entry had generation 10; this one takes
        // 11..=14 and names 14.
        w.reset(e, 10, 1);
        w.release(e, 10);
        let g = 14;
        w.reset(e, g, groups);
        let target = |k: u32| g - groups + k;
        assert!(w.landed_at(e, target(0)) && !w.landed_at(e, target(1)));
        w.land(e, target(2));
        assert!(w.landed_at(e, target(2)) && !w.landed_at(e, target(3)));
        // Never back.
        w.land(e, target(1));
        assert!(w.landed_at(e, target(2)));
        assert!(!w.released(e, g));
        w.release(e, g);
        assert!(w.landed_at(e, target(groups)) && w.released(e, g));
    }
}
