//! The job table against a simple model, over random sequences of submit,
//! start, finish, fail, release (by the owner and by others), client death,
//! server restart, and polls of issued, forged and foreign ids.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

const CLIENTS: u32 = 3;

#[derive(Clone, Debug)]
enum Op {
    Submit(u32),
    Start(usize),
    Progress(usize, u64),
    Finish(usize, u64),
    Fail(usize),
    Release(usize),
    ReleaseByOther(usize),
    ClientGone(u32),
    Restart,
    Forged {
        index: u32,
        generation: u64,
        other_epoch: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..CLIENTS).prop_map(Op::Submit),
        3 => any::<usize>().prop_map(Op::Start),
        1 => (any::<usize>(), any::<u64>()).prop_map(|(p, v)| Op::Progress(p, v)),
        3 => (any::<usize>(), any::<u64>()).prop_map(|(p, v)| Op::Finish(p, v)),
        2 => any::<usize>().prop_map(Op::Fail),
        3 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::ReleaseByOther),
        1 => (0..CLIENTS).prop_map(Op::ClientGone),
        1 => Just(Op::Restart),
        2 => (0u32..10, 0u64..6, any::<bool>()).prop_map(|(index, generation, other_epoch)| {
            Op::Forged { index, generation, other_epoch }
        }),
    ]
}

/// What the model says a job is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum M {
    Pending,
    Running,
    Done(JobResult),
    Failed(FailReason),
    Tomb(Result<JobResult, FailReason>),
}

struct Model {
    epoch: u64,
    /// Jobs issued by the current table, in issue order.
    ids: Vec<JobId>,
    jobs: HashMap<JobId, (M, u32, u32)>, // state, owner slot, owner session
    /// Current generation per index.
    generation: Vec<u64>,
    /// Per index: op number at which it was last tombstoned (None: in use or
    /// never used).
    tomb_at: Vec<Option<u64>>,
    session: [u32; CLIENTS as usize],
    /// Ids of earlier tables.
    old: Vec<JobId>,
}

impl Model {
    fn new(epoch: u64, cap: u32) -> Model {
        Model {
            epoch,
            ids: Vec::new(),
            jobs: HashMap::new(),
            generation: vec![0; cap as usize],
            tomb_at: vec![None; cap as usize],
            session: [1, 1, 1],
            old: Vec::new(),
        }
    }

    fn live(&self) -> usize {
        self.jobs
            .values()
            .filter(|(m, ..)| !matches!(m, M::Tomb(_)))
            .count()
    }

    fn expect(&self, id: JobId) -> JobStatus {
        if id.epoch != self.epoch {
            return JobStatus::Unknown;
        }
        let Some(&(m, ..)) = self.jobs.get(&id) else {
            // Never issued by this table.
            return JobStatus::Unknown;
        };
        if self.generation[id.index() as usize] > id.generation() {
            return JobStatus::Expired;
        }
        match m {
            M::Pending => JobStatus::Pending,
            M::Running => JobStatus::Running,
            M::Done(r) => JobStatus::Done(r),
            M::Failed(f) => JobStatus::Failed(f),
            M::Tomb(o) => JobStatus::Tombstoned(o),
        }
    }

    fn pick(&self, p: usize) -> Option<JobId> {
        (!self.ids.is_empty()).then(|| self.ids[p % self.ids.len()])
    }
}

fn check_all(t: &JobTable, m: &Model) {
    let r = JobReader::of_table(t);
    for id in m.ids.iter().chain(m.old.iter()) {
        let got = r.status(*id).unwrap();
        assert_eq!(got, m.expect(*id), "{id}");
        let issued_and_finished =
            !matches!(m.jobs.get(id).map(|j| j.0), Some(M::Pending | M::Running))
                || m.generation[id.index() as usize] > id.generation()
                || id.epoch != m.epoch;
        if issued_and_finished {
            assert!(
                got.is_terminal(),
                "{id} finished or foreign but reads {got:?}"
            );
        }
    }
}

fn run(ops: Vec<Op>) {
    let cap = 4;
    let mut epoch = 1000;
    let mut t = JobTable::on_heap(cap, epoch, CLIENTS);
    let mut m = Model::new(epoch, cap);
    for (n, op) in ops.into_iter().enumerate() {
        let now = n as u64 + 1;
        match op {
            Op::Submit(c) => {
                let r = t.submit(NewJob {
                    kind: JobKind::Delay,
                    owner_slot: c,
                    owner_session: m.session[c as usize],
                    user_data: now,
                    now_ns: now,
                });
                if m.live() == cap as usize {
                    assert_eq!(r, Err(TableError::Full));
                    continue;
                }
                let id = r.expect("a slot is free");
                let i = id.index() as usize;
                // Never-used slots first, then the oldest tombstone: a live
                // job's slot is never taken.
                let never_used: Vec<usize> = (0..cap as usize)
                    .filter(|&k| m.generation[k] == 0)
                    .collect();
                if !never_used.is_empty() {
                    assert_eq!(m.generation[i], 0, "a never-used slot was available");
                } else {
                    let oldest = m.tomb_at.iter().flatten().min().copied();
                    assert!(m.tomb_at[i].is_some(), "slot {i} holds a live job");
                    assert_eq!(m.tomb_at[i], oldest, "not the oldest tombstone");
                }
                assert_eq!(id.generation(), m.generation[i] + 1);
                m.generation[i] += 1;
                m.tomb_at[i] = None;
                m.ids.push(id);
                m.jobs.insert(id, (M::Pending, c, m.session[c as usize]));
            }
            Op::Start(p) => {
                let Some(id) = m.pick(p) else { continue };
                let r = t.start(id, now);
                match m.expect(id) {
                    JobStatus::Pending => {
                        r.unwrap();
                        m.jobs.get_mut(&id).unwrap().0 = M::Running;
                    }
                    JobStatus::Expired => assert_eq!(r, Err(TableError::Expired)),
                    _ => assert!(matches!(r, Err(TableError::WrongState(_))), "{r:?}"),
                }
            }
            Op::Progress(p, v) => {
                let Some(id) = m.pick(p) else { continue };
                let r = t.progress(id, v);
                assert_eq!(r.is_ok(), m.expect(id) == JobStatus::Running);
            }
            Op::Finish(p, _) | Op::Fail(p) => {
                let Some(id) = m.pick(p) else { continue };
                let (r, next) = match op {
                    Op::Finish(_, v) => {
                        let res = JobResult { value: v, aux: !v };
                        (t.finish(id, res, now), M::Done(res))
                    }
                    _ => (
                        t.fail(id, FailReason::Requested, now),
                        M::Failed(FailReason::Requested),
                    ),
                };
                match m.expect(id) {
                    JobStatus::Pending | JobStatus::Running => {
                        r.unwrap();
                        m.jobs.get_mut(&id).unwrap().0 = next;
                    }
                    JobStatus::Expired => assert_eq!(r, Err(TableError::Expired)),
                    _ => assert!(matches!(r, Err(TableError::WrongState(_))), "{r:?}"),
                }
            }
            Op::Release(p) | Op::ReleaseByOther(p) => {
                let Some(id) = m.pick(p) else { continue };
                let (_, owner, session) = m.jobs[&id];
                let by_owner = matches!(op, Op::Release(_));
                let (slot, sess) = if by_owner {
                    (owner, session)
                } else {
                    (
                        (owner + 1) % CLIENTS,
                        m.session[((owner + 1) % CLIENTS) as usize],
                    )
                };
                let r = t.release(id, slot, sess, now);
                match m.expect(id) {
                    JobStatus::Expired => assert_eq!(r, Err(TableError::Expired)),
                    _ if !by_owner => assert_eq!(r, Err(TableError::NotOwner)),
                    JobStatus::Pending | JobStatus::Running => {
                        assert_eq!(r, Err(TableError::NotFinished))
                    }
                    JobStatus::Tombstoned(_) => assert_eq!(r, Ok(table::Released::Already)),
                    JobStatus::Done(res) => {
                        assert_eq!(r, Ok(table::Released::Now));
                        m.jobs.get_mut(&id).unwrap().0 = M::Tomb(Ok(res));
                        m.tomb_at[id.index() as usize] = Some(now);
                    }
                    JobStatus::Failed(f) => {
                        assert_eq!(r, Ok(table::Released::Now));
                        m.jobs.get_mut(&id).unwrap().0 = M::Tomb(Err(f));
                        m.tomb_at[id.index() as usize] = Some(now);
                    }
                    JobStatus::Unknown => panic!("issued id reads unknown"),
                }
            }
            Op::ClientGone(c) => {
                let (failed, released) = t.client_gone(c, FailReason::ClientGone, now);
                let (mut f, mut rel) = (0, 0);
                for (id, job) in m.jobs.iter_mut() {
                    if job.1 != c || m.generation[id.index() as usize] != id.generation() {
                        continue;
                    }
                    let next = match job.0 {
                        M::Pending | M::Running => {
                            f += 1;
                            M::Tomb(Err(FailReason::ClientGone))
                        }
                        M::Done(r) => M::Tomb(Ok(r)),
                        M::Failed(x) => M::Tomb(Err(x)),
                        M::Tomb(_) => continue,
                    };
                    rel += 1;
                    job.0 = next;
                    m.tomb_at[id.index() as usize] = Some(now);
                }
                assert_eq!((failed, released), (f, rel));
                // The slot's next occupant has a new session.
                m.session[c as usize] += 1;
            }
            Op::Restart => {
                epoch += 1;
                t = JobTable::on_heap(cap, epoch, CLIENTS);
                let mut old = std::mem::take(&mut m.old);
                old.extend(m.ids.iter().copied());
                m = Model::new(epoch, cap);
                m.old = old;
            }
            Op::Forged {
                index,
                generation,
                other_epoch,
            } => {
                let id = JobId::new(
                    if other_epoch { epoch + 7 } else { epoch },
                    index,
                    generation,
                );
                let got = JobReader::of_table(&t).status(id).unwrap();
                let want = if m.jobs.contains_key(&id) {
                    m.expect(id)
                } else {
                    JobStatus::Unknown
                };
                assert_eq!(got, want, "forged {id}");
                assert_eq!(t.start(id, now).is_ok(), want == JobStatus::Pending);
                if want == JobStatus::Pending {
                    m.jobs.get_mut(&id).unwrap().0 = M::Running;
                }
            }
        }
        assert_eq!(t.live(), m.live());
        check_all(&t, &m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn job_table_agrees_with_the_model(ops in proptest::collection::vec(op(), 1..200)) {
        run(ops);
    }
}

#[test]
fn a_released_job_reads_tombstoned_then_expired_never_running() {
    let t = JobTable::on_heap(1, 7, 1);
    let r = JobReader::of_table(&t);
    let id = t
        .submit(NewJob {
            kind: JobKind::Delay,
            owner_slot: 0,
            owner_session: 1,
            user_data: 0,
            now_ns: 1,
        })
        .unwrap();
    assert_eq!(r.status(id).unwrap(), JobStatus::Pending);
    t.start(id, 2).unwrap();
    t.finish(id, JobResult { value: 5, aux: 6 }, 3).unwrap();
    assert_eq!(
        t.submit(NewJob {
            kind: JobKind::Delay,
            owner_slot: 0,
            owner_session: 1,
            user_data: 0,
            now_ns: 4,
        }),
        Err(TableError::Full),
        "a finished but unreleased job is never overwritten"
    );
    t.release(id, 0, 1, 5).unwrap();
    let done = JobResult { value: 5, aux: 6 };
    for _ in 0..10_000 {
        assert_eq!(r.status(id).unwrap(), JobStatus::Tombstoned(Ok(done)));
    }
    for n in 0..1000 {
        let next = t
            .submit(NewJob {
                kind: JobKind::Delay,
                owner_slot: 0,
                owner_session: 1,
                user_data: n,
                now_ns: 6,
            })
            .unwrap();
        assert_eq!(next.index(), id.index());
        assert_eq!(r.status(id).unwrap(), JobStatus::Expired);
        t.fail(next, FailReason::Requested, 7).unwrap();
        t.release(next, 0, 1, 8).unwrap();
    }
    let info = r.info(JobId::new(7, 0, 1001)).unwrap().unwrap();
    assert_eq!(
        info.status,
        JobStatus::Tombstoned(Err(FailReason::Requested))
    );
    assert_eq!(info.user_data, 999);
}
