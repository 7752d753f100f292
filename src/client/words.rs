//! The client's side of its job words ([`crate::job_words`]): which entry
//! each STORE and RETRIEVE in flight has, giving a job up (so nothing of it
//! touches the engine's memory afterwards), and the watcher that releases
//! engine streams waiting for jobs whose server died or stalled.

use super::connect::Link;
use crate::error::{Error, Result};
use crate::jobs::JobId;
use crate::job_words::JOB_WORDS;
use std::collections::{HashMap, VecDeque};
#[cfg(feature = "cuda")]
use std::sync::{Arc, Weak};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a client that gave a job up waits for a copy already under way
/// to end (a chunk copy takes about a millisecond; on a GPU it runs to its
/// end whatever the server process does, unless the device itself hangs).
pub const QUIESCE_BOUND: Duration = Duration::from_secs(5);

/// How often the watcher looks at the jobs some stream waits for.
#[cfg(feature = "cuda")]
const WATCH_EVERY: Duration = Duration::from_millis(1);

/// Why a client gave a job up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GaveUp {
    /// Its deadline passed: this long after it was submitted.
    Deadline(Duration),
    /// The server is gone.
    ServerGone,
    /// Given up by the caller ([`super::Job::give_up`]).
    Asked,
}

/// How a give-up ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GiveUp {
    pub why: GaveUp,
    /// No copy of the job was under way any more (or the server was gone)
    /// when the job's streams were released; false: the bound passed first.
    pub quiet: bool,
}

impl GiveUp {
    /// The error a wait on the job reports.
    pub fn error(self, job: JobId) -> Error {
        if !self.quiet {
            return Error::CopiesInFlight(job);
        }
        match self.why {
            GaveUp::Deadline(d) => Error::Timeout(d),
            GaveUp::ServerGone => Error::ServerGone,
            GaveUp::Asked => Error::JobFailed(crate::jobs::FailReason::Cancelled),
        }
    }
}

// `submitted` and `watched` serve the watcher (engine streams: `cuda`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct InFlight {
    generation: u32,
    /// Set once the server accepted the job.
    job: Option<JobId>,
    submitted: Instant,
    deadline: Instant,
    /// A stream waits for it: the watcher gives it up at its deadline or
    /// when the server dies, whoever else waits.
    watched: bool,
    /// A give-up is under way (its `go` store is still to come): the entry
    /// is not reused before it ends.
    giving_up: bool,
    gave_up: Option<GiveUp>,
}

impl InFlight {
    /// Whether the entry can go to another job: its job ended on the
    /// server (`ended`), its streams were released and no copy of it is
    /// under way, and no give-up of it is still running.
    fn reusable(&self, entry: u32, words: &crate::job_words::Words<'_>, ended: bool) -> bool {
        ended
            && !self.giving_up
            && words.released(entry, self.generation)
            && words.quiescent(entry)
    }
}

#[derive(Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct State {
    free: VecDeque<u32>,
    next_generation: u32,
    busy: HashMap<u32, InFlight>,
    watcher: bool,
}

impl State {
    /// Generation `g` of `entry`, while in flight.
    fn of(&self, entry: u32, g: u32) -> Option<&InFlight> {
        self.busy.get(&entry).filter(|f| f.generation == g)
    }

    fn of_mut(&mut self, entry: u32, g: u32) -> Option<&mut InFlight> {
        self.busy.get_mut(&entry).filter(|f| f.generation == g)
    }

    /// Frees `entry` if generation `g`, whose job ended, left it reusable.
    fn free_ended(&mut self, entry: u32, g: u32, words: &crate::job_words::Words<'_>) {
        if self.of(entry, g).is_some_and(|f| f.reusable(entry, words, true)) {
            self.busy.remove(&entry);
            self.free.push_back(entry);
        }
    }
}

/// One connection's job words table.
pub(crate) struct WordTable {
    state: Mutex<State>,
    /// Wakes the watcher (engine streams: `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    wake: Condvar,
    /// Notified when a give-up ends (for callers waiting for another's).
    settled: Condvar,
}

impl WordTable {
    pub fn new() -> WordTable {
        WordTable {
            state: Mutex::new(State {
                free: (0..JOB_WORDS).collect(),
                next_generation: 1,
                ..State::default()
            }),
            wake: Condvar::new(),
            settled: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An entry and a generation for a new job that gives up `timeout`
    /// after now, in `groups` layer groups (1: any job but a RETRIEVE in
    /// layer groups): the job takes that many generations, and is named by
    /// the last ([`crate::job_words`]). Entries are reused oldest first,
    /// and only once their last job ended on the server, was released and
    /// has no copy under way.
    pub fn take(&self, link: &Link, timeout: Duration, groups: u32) -> Result<(u32, u32)> {
        if self.lock().free.is_empty() {
            settle(self, link);
        }
        let mut st = self.lock();
        let Some(entry) = st.free.pop_front() else {
            return Err(Error::InvalidArgument(format!(
                "{JOB_WORDS} STORE and RETRIEVE jobs of this client are in flight: \
                 wait for one to end"
            )));
        };
        let groups = groups.max(1);
        let g = st.next_generation.wrapping_add(groups - 1);
        st.next_generation = g.wrapping_add(1);
        link.words().reset(entry, g, groups);
        let now = Instant::now();
        st.busy.insert(
            entry,
            InFlight {
                generation: g,
                job: None,
                submitted: now,
                deadline: now
                    .checked_add(timeout)
                    .unwrap_or(now + Duration::from_secs(1 << 40)),
                watched: false,
                giving_up: false,
                gave_up: None,
            },
        );
        Ok((entry, g))
    }

    /// The server accepted the job of `entry`.
    pub fn bind(&self, entry: u32, job: JobId) {
        if let Some(f) = self.lock().busy.get_mut(&entry) {
            f.job = Some(job);
        }
    }

    /// The server refused the job: nothing of it ever ran.
    pub fn put_back(&self, entry: u32) {
        let mut st = self.lock();
        if st.busy.remove(&entry).is_some() {
            st.free.push_back(entry);
        }
    }

    /// The request of generation `g` of `entry` got no answer (the call
    /// timed out, or the connection broke): the server may still run it.
    /// It is given up at once (whatever of it runs later copies nothing);
    /// its entry is reused only if a late answer names its job
    /// ([`WordTable::bind`]) and that job ended, or the server refused it.
    pub fn abandon(&self, link: &Link, entry: u32, g: u32) {
        link.words().give_up(entry, g);
        if let Some(f) = self.lock().of_mut(entry, g) {
            f.gave_up = Some(GiveUp {
                why: GaveUp::Asked,
                quiet: false,
            });
        }
    }

    /// The job of `entry` ended on the server: its entry can be reused
    /// (once it was released and no copy of it is under way).
    pub fn ended(&self, link: &Link, entry: u32, g: u32) {
        self.lock().free_ended(entry, g, &link.words());
    }

    /// Time since generation `g` of `entry` was submitted.
    pub fn age(&self, entry: u32, g: u32) -> Option<Duration> {
        self.lock().of(entry, g).map(|f| f.submitted.elapsed())
    }

    /// How generation `g` of `entry` was given up, if it was.
    pub fn given_up(&self, entry: u32, g: u32) -> Option<GiveUp> {
        self.lock().of(entry, g).and_then(|f| f.gave_up)
    }

    /// The job's deadline (for waits that must give it up there).
    pub fn deadline(&self, entry: u32, g: u32) -> Option<Instant> {
        self.lock().of(entry, g).map(|f| f.deadline)
    }

    /// Gives generation `g` of `entry` up (once; later calls answer the
    /// first's outcome): see [`WordTable::give_up_all_within`].
    pub fn give_up(&self, link: &Link, entry: u32, g: u32, why: GaveUp) -> Option<GiveUp> {
        self.give_up_within(link, entry, g, why, QUIESCE_BOUND)
    }

    /// `give_up`, waiting at most `bound` for a copy under way.
    pub fn give_up_within(
        &self,
        link: &Link,
        entry: u32,
        g: u32,
        why: GaveUp,
        bound: Duration,
    ) -> Option<GiveUp> {
        self.give_up_all_within(link, &[(entry, g, why)], bound)
            .into_iter()
            .next()
            .flatten()
    }

    /// Gives jobs up, all at once: stores each one's `cancel`, then waits
    /// until no copy of any of them is under way (or the server process is
    /// gone; at most [`QUIESCE_BOUND`] for all of them together), then
    /// releases the streams that wait for them. A job given up before
    /// answers that give-up's outcome; one not in flight (it ended and its
    /// entry moved on), `None`. `bound`: at most this long instead of
    /// [`QUIESCE_BOUND`].
    pub fn give_up_all_within(
        &self,
        link: &Link,
        jobs: &[(u32, u32, GaveUp)],
        bound: Duration,
    ) -> Vec<Option<GiveUp>> {
        let mut out: Vec<Option<GiveUp>> = vec![None; jobs.len()];
        let mut mine = Vec::new();
        {
            let mut st = self.lock();
            for (i, &(e, g, why)) in jobs.iter().enumerate() {
                let Some(f) = st.of_mut(e, g) else {
                    continue;
                };
                if let Some(done) = f.gave_up {
                    out[i] = Some(done);
                } else if !f.giving_up {
                    f.giving_up = true;
                    mine.push((i, e, g, why));
                }
            }
        }
        let words = link.words();
        for &(_, e, g, _) in &mine {
            words.give_up(e, g);
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        let mut quiet = vec![false; mine.len()];
        loop {
            let exited = link.server_exited();
            for (q, &(_, e, _, _)) in quiet.iter_mut().zip(&mine) {
                *q = *q || exited || words.quiescent(e);
            }
            if quiet.iter().all(|&q| q) || start.elapsed() >= bound {
                break;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        for (&(_, e, g, _), &q) in mine.iter().zip(&quiet) {
            if !q {
                tracing::warn!(
                    entry = e,
                    "a copy of a given-up job was still under way after {bound:?}; \
                     its streams are released anyway"
                );
            }
            words.release(e, g);
        }
        let mut st = self.lock();
        for (&(i, e, g, why), &q) in mine.iter().zip(&quiet) {
            let outcome = GiveUp { why, quiet: q };
            if let Some(f) = st.of_mut(e, g) {
                f.giving_up = false;
                f.gave_up = Some(outcome);
            }
            out[i] = Some(outcome);
        }
        self.settled.notify_all();
        // Another caller is giving the rest up: wait for its outcome (its
        // bound, plus a margin), so no caller returns before the copies of
        // a job it gave up are over.
        let until = Instant::now() + bound.max(QUIESCE_BOUND) + Duration::from_secs(1);
        loop {
            let mut waiting = false;
            for (i, &(e, g, _)) in jobs.iter().enumerate() {
                if out[i].is_some() {
                    continue;
                }
                match st.of(e, g) {
                    Some(f) if f.giving_up => waiting = true,
                    Some(f) => out[i] = f.gave_up,
                    None => {}
                }
            }
            let now = Instant::now();
            if !waiting || now >= until {
                return out;
            }
            st = self
                .settled
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    #[cfg(feature = "cuda")]
    /// A stream waits for generation `g` of `entry`: from now on the
    /// watcher gives it up at its deadline or when the server dies.
    pub fn watch(self: &Arc<Self>, link: &Arc<Link>, entry: u32, g: u32) -> Result<()> {
        let start = {
            let mut st = self.lock();
            if let Some(f) = st.of_mut(entry, g) {
                f.watched = true;
            }
            !std::mem::replace(&mut st.watcher, true)
        };
        if start {
            let (table, link) = (Arc::downgrade(self), Arc::downgrade(link));
            let spawned = std::thread::Builder::new()
                .name("kvring-words".into())
                .spawn(move || watch(table, link));
            if let Err(e) = spawned {
                self.lock().watcher = false;
                return Err(Error::Io {
                    context: "spawn the job words watcher".into(),
                    source: e,
                });
            }
        }
        self.wake.notify_all();
        Ok(())
    }
}

/// Frees the entries whose job ended on the server (and were released,
/// with no copy under way). The job table is read with the table unlocked
/// (a read may wait for a slot being written); only entries still of the
/// same generation are freed.
fn settle(table: &WordTable, link: &Link) {
    let jobs: Vec<(u32, u32, JobId)> = {
        let st = table.lock();
        st.busy
            .iter()
            .filter_map(|(&e, f)| f.job.map(|id| (e, f.generation, id)))
            .collect()
    };
    if jobs.is_empty() {
        return;
    }
    let Ok(reader) = link.jobs() else {
        return;
    };
    // A read error (a slot being written, or inconsistent) says nothing:
    // not ended. A reused slot reads as ended.
    let ended: Vec<(u32, u32)> = jobs
        .into_iter()
        .filter(|&(_, _, id)| reader.status(id).is_ok_and(|s| s.is_terminal()))
        .map(|(e, g, _)| (e, g))
        .collect();
    let words = link.words();
    let mut st = table.lock();
    for (e, g) in ended {
        st.free_ended(e, g, &words);
    }
}

#[cfg(feature = "cuda")]
/// The watcher: while some stream waits for a job, looks every
/// millisecond at the server's life and the jobs' deadlines, and gives up
/// what must be; frees entries whose job ended. Sleeps while nothing is
/// watched; ends with the connection.
fn watch(table: Weak<WordTable>, link: Weak<Link>) {
    loop {
        let Some(table) = table.upgrade() else {
            return;
        };
        let pause = {
            let Some(link) = link.upgrade() else {
                return;
            };
            settle(&table, &link);
            let st = table.lock();
            let watched = st.busy.values().any(|f| f.watched && f.gave_up.is_none());
            if !watched {
                // Nothing to watch: sleep until a stream waits again
                // (bounded, so a dropped connection ends this thread), the
                // connection not held meanwhile.
                drop(link);
                let _ = table
                    .wake
                    .wait_timeout(st, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let gone = link.server_gone();
            let now = Instant::now();
            let due: Vec<(u32, u32, GaveUp)> = st
                .busy
                .iter()
                .filter(|(_, f)| f.watched && f.gave_up.is_none() && !f.giving_up)
                .filter_map(|(&e, f)| {
                    if gone {
                        Some((e, f.generation, GaveUp::ServerGone))
                    } else if now >= f.deadline {
                        Some((e, f.generation, GaveUp::Deadline(now - f.submitted)))
                    } else {
                        None
                    }
                })
                .collect();
            drop(st);
            if !due.is_empty() {
                // On a thread of its own (it may wait up to the bound), so
                // the watcher goes on seeing other deadlines and the
                // server's death.
                let (t, l) = (table.clone(), link.clone());
                let spawned = std::thread::Builder::new()
                    .name("kvring-give-up".into())
                    .spawn(move || {
                        t.give_up_all_within(&l, &due, QUIESCE_BOUND);
                    });
                if let Err(e) = spawned {
                    tracing::warn!("spawn a give-up thread: {e}");
                }
            }
            WATCH_EVERY
        };
        drop(table);
        std::thread::sleep(pause);
    }
}
