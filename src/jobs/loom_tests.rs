//! Model checking of a job slot: the seqlock never hands out a torn copy, and
//! racing writers (the thread finishing a job, the one reclaiming a dead
//! client's jobs) leave a state the contract allows, which readers never see
//! go back from terminal to running.

use super::slot::{JobSlot, SlotUpdate};
use super::{decode, step, FailReason, JobId, JobState, JobStatus, Transition};
use loom::sync::Arc;
use loom::thread;

#[test]
fn loom_seqlock_never_returns_a_torn_copy() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| {
        let slot = Arc::new(JobSlot::new());
        let writer = {
            let slot = slot.clone();
            thread::spawn(move || {
                for k in 1..=2u64 {
                    let w = slot.lock();
                    w.apply(&SlotUpdate {
                        generation: Some(k),
                        result_value: Some(k * 10),
                        result_aux: Some(k * 100),
                        ..Default::default()
                    });
                }
            })
        };
        let mut last = 0;
        for _ in 0..2 {
            if let Some(s) = slot.try_read_status() {
                assert_eq!(s.result_value, s.generation * 10, "torn copy {s:?}");
                assert_eq!(s.result_aux, s.generation * 100, "torn copy {s:?}");
                assert!(s.generation >= last, "went back in time");
                last = s.generation;
            }
        }
        writer.join().unwrap();
        let s = slot.try_read_status().expect("no writer left");
        assert_eq!((s.generation, s.result_value, s.result_aux), (2, 20, 200));
    });
}

/// What `JobTable` does for one transition: under the slot's lock, check the
/// generation, take the state machine's step, store the update.
fn transition(slot: &JobSlot, generation: u64, t: Transition, u: SlotUpdate) -> bool {
    let w = slot.lock();
    let cur = w.current();
    if cur.status.generation != generation {
        return false;
    }
    let state = JobState::decode(cur.status.state).ok().unwrap();
    let Ok(next) = step(state, t) else {
        return false;
    };
    let mut u = u;
    u.state = Some(next as u32);
    if t == Transition::Reclaim && step(state, Transition::Fail).is_ok() {
        u.fail_reason = Some(FailReason::ClientGone.code());
    }
    w.apply(&u);
    true
}

#[test]
fn loom_racing_writers_end_terminal_and_readers_never_see_running_again() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    model.check(|| {
        let slot = Arc::new(JobSlot::new());
        let id = JobId::new(1, 0, 1);
        slot.lock().apply(&SlotUpdate {
            generation: Some(1),
            state: Some(JobState::Running as u32),
            ..Default::default()
        });
        let worker = {
            let slot = slot.clone();
            thread::spawn(move || {
                transition(
                    &slot,
                    1,
                    Transition::Finish,
                    SlotUpdate {
                        result_value: Some(42),
                        ..Default::default()
                    },
                )
            })
        };
        let reclaimer = {
            let slot = slot.clone();
            thread::spawn(move || transition(&slot, 1, Transition::Reclaim, SlotUpdate::default()))
        };
        let mut seen_terminal = false;
        for _ in 0..2 {
            if let Some(s) = slot.try_read_status() {
                let st = decode(id, 1, 1, &s).expect("a state the server writes");
                if seen_terminal {
                    assert!(st.is_terminal(), "terminal, then {st:?}");
                }
                seen_terminal |= st.is_terminal();
            }
        }
        let finished = worker.join().unwrap();
        assert!(reclaimer.join().unwrap(), "reclaim always applies");
        let s = slot.try_read_status().unwrap();
        let st = decode(id, 1, 1, &s).unwrap();
        let want = if finished {
            JobStatus::Tombstoned(Ok(super::JobResult { value: 42, aux: 0 }))
        } else {
            JobStatus::Tombstoned(Err(FailReason::ClientGone))
        };
        assert_eq!(st, want);
    });
}
