//! Text rendering of the inspector's views, and the live `watch` screen.

use kvring::inspect::{self, JobRow, Rates, SegmentEntry, Snapshot, Thresholds};
use kvring::segment::ReadOnlySegment;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or("-".to_string(), |v| v.to_string())
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

fn us(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(u) if u >= 10_000.0 => format!("<={:.0}ms", u / 1e3),
        Some(u) => format!("<={u:.0}us"),
    }
}

pub fn list(entries: &[SegmentEntry]) {
    println!(
        "{:<24} {:>8} {:>6} {:>20} {:>7} {:>10}  note",
        "name", "pid", "alive", "epoch", "clients", "age"
    );
    for e in entries {
        println!(
            "{:<24} {:>8} {:>6} {:>20} {:>7} {:>10}  {}",
            e.name,
            opt(&e.server_pid),
            e.alive.map_or("-", |a| if a { "yes" } else { "DEAD" }),
            opt(&e.epoch),
            opt(&e.clients_connected),
            e.age_s.map_or("-".into(), |a| format!("{a:.0}s")),
            e.error.as_deref().unwrap_or("")
        );
    }
    if entries.is_empty() {
        println!("(no kvring segments of this user in /dev/shm)");
    }
}

/// The `show` text; `rates` adds the live rates line (watch).
pub fn show(s: &Snapshot, rates: Option<Rates>) -> String {
    let mut o = String::new();
    server(&mut o, s, rates);
    clients(&mut o, s);
    jobs_and_ops(&mut o, s);
    pool_and_tier(&mut o, s);
    lanes_and_models(&mut o, s);
    anomalies(&mut o, s);
    o
}

/// The segment, the server and its clients' counts, and the rates.
fn server(o: &mut String, s: &Snapshot, rates: Option<Rates>) {
    let sv = &s.server;
    let _ = writeln!(
        o,
        "segment {} (layout {}, epoch {}, {} MiB, up {:.0} s)",
        s.name,
        sv.layout_version,
        sv.epoch,
        s.geometry.segment_bytes >> 20,
        sv.age_s
    );
    let _ = writeln!(
        o,
        "server pid {}: {}, {}, heartbeat {}, ring thread {}",
        sv.pid,
        if sv.alive { "alive" } else { "DEAD" },
        sv.state,
        sv.heartbeat_age_ms
            .map_or("unreadable".into(), |a| format!("{a:.0} ms ago")),
        if sv.ring_thread_sleeping {
            "parked"
        } else {
            "running"
        }
    );
    let _ = writeln!(
        o,
        "clients: {} connected (accepted {}, reclaimed {}, refused {})",
        sv.clients_connected, sv.clients_accepted, sv.clients_reclaimed, sv.clients_refused
    );
    if let Some(r) = rates {
        let _ = writeln!(
            o,
            "rates: {:.0} requests/s, {:.1} MB/s copied, {:.0} jobs/s",
            r.requests_per_s,
            r.bytes_per_s / 1e6,
            r.jobs_per_s
        );
    }
}

/// A row per client slot.
fn clients(o: &mut String, s: &Snapshot) {
    if !s.clients.is_empty() {
        let _ = writeln!(
            o,
            "{:>4} {:<11} {:>8} {:>5} {:>4} {:>17} {:>17} {:>5} {:>7} {:>5} {:>9} {:>9}",
            "slot",
            "state",
            "pid",
            "alive",
            "inst",
            "req used/cap",
            "cq used/cap",
            "infl",
            "credits",
            "sleep",
            "served",
            "rejected"
        );
        for c in &s.clients {
            let ring = |r: &inspect::RingView| {
                if r.consistent {
                    format!("{}/{}", r.used, r.capacity)
                } else {
                    format!("BAD {}..{}", r.head, r.tail)
                }
            };
            let _ = writeln!(
                o,
                "{:>4} {:<11} {:>8} {:>5} {:>4} {:>17} {:>17} {:>5} {:>7} {:>5} {:>9} {:>9}",
                c.slot,
                c.state,
                c.pid,
                if c.alive { "yes" } else { "no" },
                c.kv_instances,
                ring(&c.request_ring),
                ring(&c.completion_ring),
                c.in_flight,
                c.credits,
                if c.sleeping { "yes" } else { "no" },
                c.requests_served,
                c.requests_rejected
            );
        }
    }
}

/// The job table's counts and each operation's latency.
fn jobs_and_ops(o: &mut String, s: &Snapshot) {
    let states: Vec<String> = s
        .jobs
        .by_state
        .iter()
        .filter(|(k, _)| k.as_str() != "free")
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    let _ = writeln!(
        o,
        "jobs: {} (submitted {}, done {}, failed {}, released {}, refused {}, slots retired {})",
        if states.is_empty() {
            "none".to_string()
        } else {
            states.join(", ")
        },
        s.jobs.submitted,
        s.jobs.done,
        s.jobs.failed,
        s.jobs.released,
        s.jobs.refused,
        s.jobs.retired
    );
    if let Some(j) = &s.jobs.oldest_unfinished {
        let _ = writeln!(
            o,
            "  oldest unfinished: {} job {} (slot {}) of client slot {}, {} for {:.1} s",
            j.kind, j.id, j.index, j.owner_slot, j.state, j.age_s
        );
    }
    let _ = writeln!(
        o,
        "{:<18} {:>10} {:>8} {:>10} {:>10}",
        "operation", "count", "errors", "p50", "p99"
    );
    for op in s.ops.iter().filter(|op| op.count > 0) {
        let _ = writeln!(
            o,
            "{:<18} {:>10} {:>8} {:>10} {:>10}",
            op.name,
            op.count,
            op.errors,
            us(op.p50_us),
            us(op.p99_us)
        );
    }
}

/// The pool and the tier below it.
fn pool_and_tier(o: &mut String, s: &Snapshot) {
    let c = &s.cache;
    let _ = writeln!(
        o,
        "pool: {} / {} MiB used, {} objects, {} leases, {} instances; stored {} MiB, retrieved {} MiB, evicted {} objects",
        mib(c.pool_used_bytes),
        mib(c.pool_bytes),
        c.objects,
        c.leases,
        c.instances,
        mib(c.stored_bytes),
        mib(c.retrieved_bytes),
        c.evicted_objects
    );
    if c.pinned_objects > 0 || s.server.pool_ready_bytes < c.pool_bytes {
        let _ = writeln!(
            o,
            "      {} MiB ready for copies, {} objects ({} MiB) pinned",
            mib(s.server.pool_ready_bytes),
            c.pinned_objects,
            mib(c.pinned_bytes)
        );
    }
    let tier = c.tier_state();
    if tier != Ok(kvring::proto::kv::TierState::None) {
        let _ = writeln!(
            o,
            "remote tier: {}, {} queued; written {} objects ({} dropped), loaded {} ({} missed, {} corrupt), {} MiB out, {} MiB in, {} errors; lookups found {} chunks there",
            tier.map_or("?", |t| t.name()),
            c.l2_queue,
            c.l2_written_objects,
            c.l2_write_dropped_objects,
            c.l2_loaded_objects,
            c.l2_missed_objects,
            c.l2_corrupt_objects,
            mib(c.l2_bytes_out),
            mib(c.l2_bytes_in),
            c.l2_errors,
            c.lookup_l2_hit_chunks
        );
    }
    let disk = c.disk_tier_state();
    if disk != Ok(kvring::proto::kv::TierState::None) {
        let _ = writeln!(
            o,
            "disk tier: {}, {} objects, {} / {} MiB, {} queued; written {} objects ({} dropped), loaded {} ({} missed, {} corrupt), {} MiB out, {} MiB in, {} errors; lookups found {} chunks there",
            disk.map_or("?", |t| t.name()),
            c.disk_objects,
            mib(c.disk_used_bytes),
            mib(c.disk_capacity_bytes),
            c.disk_queue,
            c.disk_written_objects,
            c.disk_write_dropped_objects,
            c.disk_loaded_objects,
            c.disk_missed_objects,
            c.disk_corrupt_objects,
            mib(c.disk_bytes_out),
            mib(c.disk_bytes_in),
            c.disk_errors,
            c.lookup_disk_hit_chunks
        );
    }
    // A server with an event stream starts it with a resync.
    if c.events_resyncs > 0 {
        let _ = writeln!(
            o,
            "KV events: {} published, {} records dropped (queue full), {} resyncs",
            c.events_published, c.events_dropped, c.events_resyncs
        );
    }
}

/// The copy lanes, and lookups by model.
fn lanes_and_models(o: &mut String, s: &Snapshot) {
    for l in &s.lanes {
        let _ = writeln!(
            o,
            "copy lane {} ({}): {} workers, {} queued, {} in flight, {} held for events, {} copies; events waited {}, timed out {}; stalled {}",
            l.lane,
            l.device,
            l.workers.len(),
            l.queued,
            l.in_flight,
            l.held,
            l.copies,
            l.events_waited,
            l.events_timed_out,
            l.stalled_ms()
                .map_or("?".into(), |ms| format!("{:.1} s", ms / 1e3))
        );
    }
    for m in &s.models {
        let _ = writeln!(
            o,
            "lookups of model {} salt {}: {} requests, {} / {} tokens found",
            m.model, m.salt, m.lookups, m.hit_tokens, m.tokens
        );
    }
}

/// What the checks found.
fn anomalies(o: &mut String, s: &Snapshot) {
    if s.anomalies.is_empty() {
        let _ = writeln!(o, "anomalies: none");
    } else {
        let _ = writeln!(o, "anomalies:");
        for a in &s.anomalies {
            let _ = writeln!(o, "  ! {}: {}", a.kind, a.message);
        }
    }
}

pub fn jobs(rows: &[&JobRow]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:>6} {:>6} {:<28} {:<9} {:<11} {:>5} {:>12} {:>12} {:>10} {:>10}  failure",
        "slot", "gen", "id", "kind", "state", "owner", "value", "aux", "age s", "took ms"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:>6} {:>6} {:<28} {:<9} {:<11} {:>5} {:>12} {:>12} {:>10.2} {:>10}  {}",
            r.index,
            r.generation,
            r.id,
            r.kind,
            r.state,
            r.owner_slot,
            r.result_value,
            r.result_aux,
            r.age_s,
            r.duration_ms.map_or("-".into(), |d| format!("{d:.2}")),
            r.fail_reason.as_deref().unwrap_or("")
        );
    }
    if rows.is_empty() {
        let _ = writeln!(o, "(no jobs)");
    }
    o
}

/// The live view: alternate screen, redrawn every `every`, anomalies in red,
/// `q` (or Esc, Ctrl-C) quits.
pub fn watch(seg: &ReadOnlySegment, th: Thresholds, every: Duration) -> std::io::Result<()> {
    use crossterm::event::{self, Event, KeyCode, KeyModifiers};
    use crossterm::style::{Color, Print, ResetColor, SetForegroundColor};
    use crossterm::{cursor, execute, queue, terminal};
    use std::io::Write;

    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = terminal::disable_raw_mode();
            let _ = execute!(
                std::io::stdout(),
                cursor::Show,
                terminal::LeaveAlternateScreen
            );
        }
    }
    terminal::enable_raw_mode()?;
    let _restore = Restore;
    let mut out = std::io::stdout();
    execute!(out, terminal::EnterAlternateScreen, cursor::Hide)?;
    let mut prev = inspect::snapshot(seg, th);
    let mut next = Instant::now();
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                    return Ok(());
                }
            }
            continue;
        }
        next = Instant::now() + every;
        let mut cur = inspect::snapshot(seg, th);
        inspect::compare(&prev, &mut cur);
        let rates = inspect::rates(&prev, &cur);
        let text = show(&cur, Some(rates));
        queue!(
            out,
            cursor::MoveTo(0, 0),
            terminal::Clear(terminal::ClearType::All),
            Print(format!(
                "kvring-inspect watch {} (every {} ms; q quits)\r\n",
                cur.name,
                every.as_millis()
            ))
        )?;
        for line in text.lines() {
            if line.trim_start().starts_with('!') || line.contains("DEAD") {
                queue!(
                    out,
                    SetForegroundColor(Color::Red),
                    Print(line),
                    ResetColor,
                    Print("\r\n")
                )?;
            } else {
                queue!(out, Print(line), Print("\r\n"))?;
            }
        }
        out.flush()?;
        prev = cur;
    }
}
