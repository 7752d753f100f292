//! `disk`: the disk tier's store next to the same disk's raw direct I/O,
//! in one run, through the same I/O (io_uring, or the threads where the
//! kernel refuses it) at the same queue depth. Each round writes `objects`
//! records of the store's record size to a preallocated file with direct
//! I/O, in batches of `batch` records with up to `queue-depth` in flight,
//! and reads them back the same way; and puts the same objects (in
//! block-aligned memory, as the pool's are) into a fresh store in batches
//! as large (sealing each, allocating its segments as it goes) and gets
//! them back (each checked against its key and seal). Rounds alternate
//! which goes first. GB/s per round (median and range over rounds), the
//! time per batch and per record of a batch over all rounds, and store
//! over raw.

use crate::stats::{Spread, Summary};
use kvring_server::disk::io::{self as disk_io, DiskIo, IoOp, ThreadIo, Way};
use kvring_server::disk::{record_bytes, AlignedBuf, DiskStore, Get};
use kvring_server::l2::value::Seal;
use serde_json::json;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Opts {
    /// Print the JSON object (always the last line of stdout).
    #[arg(long)]
    json: bool,
    /// A directory on the disk to measure (a folder of this run is made
    /// in it and removed at the end).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Bytes of each object (a chunk object; the record adds a 64-byte
    /// header and pads to 4 KiB).
    #[arg(long, default_value = "4MiB", value_parser = kvring::units::parse_bytes)]
    object_bytes: u64,
    /// Objects per round.
    #[arg(long, default_value_t = 128)]
    objects: usize,
    /// Rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds of PING round trips timed on a server with a disk tier,
    /// idle and while another engine keeps the tier writing and reading,
    /// and under that load without the tier (0: not measured;
    /// `crate::disk_rings`).
    #[arg(long, default_value_t = 3.0)]
    rings_s: f64,
    /// Transfers in flight at most, raw and store alike.
    #[arg(long, default_value_t = kvring_server::disk::QUEUE_DEPTH)]
    queue_depth: usize,
    /// Records per batch (one `put_many`/`get_many` of the store; the raw
    /// side waits for its batch's last transfer before the next batch).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// The I/O, raw and store alike: `uring` (io_uring, or the threads
    /// where the kernel refuses it) or `threads`.
    #[arg(long, default_value = "uring")]
    io: String,
}

/// The I/O `o` asks for.
fn make_io(o: &Opts) -> std::io::Result<Box<dyn DiskIo>> {
    match o.io.as_str() {
        "threads" => Ok(Box::new(ThreadIo::new(o.queue_depth)?)),
        _ => disk_io::open(o.queue_depth),
    }
}

/// Removes the run's folder at the end.
struct Folder(PathBuf);

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Default)]
struct Side {
    write_gbps: Vec<f64>,
    read_gbps: Vec<f64>,
    /// Time of each batch, and its records.
    write_ns: Vec<(u64, usize)>,
    read_ns: Vec<(u64, usize)>,
}

impl Side {
    fn to_json(&self) -> serde_json::Value {
        let s = |v: &[f64]| Spread::of(v).map(|s| s.to_json());
        let batch = |v: &[(u64, usize)]| us(&v.iter().map(|b| b.0).collect::<Vec<_>>());
        let per =
            |v: &[(u64, usize)]| us(&v.iter().map(|&(t, n)| t / n as u64).collect::<Vec<_>>());
        json!({
            "write_gbps": s(&self.write_gbps),
            "read_gbps": s(&self.read_gbps),
            "write_batch_us": batch(&self.write_ns),
            "read_batch_us": batch(&self.read_ns),
            "write_us_per_record": per(&self.write_ns),
            "read_us_per_record": per(&self.read_ns),
        })
    }

    fn median(v: &[f64]) -> f64 {
        Spread::of(v).map_or(f64::NAN, |s| s.median)
    }
}

/// Times in microseconds: p50, p99, min, max.
fn us(ns: &[u64]) -> serde_json::Value {
    let s = Summary::of(ns.to_vec());
    let u = |v: u64| v as f64 / 1e3;
    json!({ "p50": u(s.p50), "p99": u(s.p99), "min": u(s.min), "max": u(s.max), "samples": s.n })
}

/// Object `i`, in block-aligned memory as the pool's objects are.
fn object(i: usize, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::zeroed(len);
    for (j, x) in b.iter_mut().enumerate() {
        *x = (j as u64)
            .wrapping_mul(0x9e37_79b9)
            .wrapping_add(i as u64 * 131) as u8;
    }
    b
}

fn gbps(bytes: u64, t: std::time::Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// `n` records of `rec` bytes, record `i` at `rec * i` of `fd`.
#[derive(Clone, Copy)]
struct Records {
    fd: i32,
    rec: u64,
    n: usize,
}

/// Transfers of every record of `r`, in batches of `batch`, up to
/// `io.depth()` in flight, each from or into one of the `bufs` (one per
/// transfer in flight): the time of each batch.
fn raw_pass(
    io: &mut dyn DiskIo,
    way: Way,
    r: Records,
    bufs: &mut [AlignedBuf],
    batch: usize,
    times: &mut Vec<(u64, usize)>,
) -> std::io::Result<()> {
    let Records { fd, rec, n } = r;
    let mut free: Vec<usize> = (0..bufs.len()).collect();
    let wait = |io: &mut dyn DiskIo, free: &mut Vec<usize>| -> std::io::Result<()> {
        let d = io.wait()?;
        let moved = d.result?;
        if moved as u64 != rec {
            return Err(std::io::Error::other(format!("{moved} of {rec} bytes")));
        }
        free.push(d.token as usize);
        Ok(())
    };
    for first in (0..n).step_by(batch) {
        let t = Instant::now();
        let last = (first + batch).min(n);
        for i in first..last {
            if io.in_flight() == io.depth() {
                wait(io, &mut free)?;
            }
            let slot = free.pop().expect("a buffer per transfer in flight");
            let op = IoOp::new(slot as u64, way, fd, i as u64 * rec)
                .buf(bufs[slot].as_mut_ptr(), rec as usize);
            // SAFETY: `bufs[slot]` is this transfer's alone until its end
            // comes back (the slot is free again only then), and every
            // transfer ends before this function returns.
            unsafe { io.submit(op) }?;
        }
        while io.in_flight() > 0 {
            wait(io, &mut free)?;
        }
        times.push((t.elapsed().as_nanos() as u64, last - first));
    }
    Ok(())
}

/// Raw direct I/O of `n` records of `rec` bytes: writes, then reads.
fn raw_round(dir: &Path, rec: u64, n: usize, o: &Opts, side: &mut Side) -> std::io::Result<()> {
    let path = dir.join("raw.bin");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    nix::fcntl::posix_fallocate(&f, 0, (rec * n as u64) as libc::off_t)?;
    let mut io = make_io(o)?;
    let mut bufs: Vec<AlignedBuf> = (0..io.depth())
        .map(|k| {
            let mut b = AlignedBuf::zeroed(rec as usize);
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i * 7 + k) as u8;
            }
            b
        })
        .collect();
    let records = Records {
        fd: f.as_raw_fd(),
        rec,
        n,
    };
    let t = Instant::now();
    raw_pass(
        &mut *io,
        Way::Write,
        records,
        &mut bufs,
        o.batch,
        &mut side.write_ns,
    )?;
    side.write_gbps.push(gbps(rec * n as u64, t.elapsed()));
    let t = Instant::now();
    raw_pass(
        &mut *io,
        Way::Read,
        records,
        &mut bufs,
        o.batch,
        &mut side.read_ns,
    )?;
    side.read_gbps.push(gbps(rec * n as u64, t.elapsed()));
    drop(io);
    drop(f);
    std::fs::remove_file(path)
}

/// The store: `n` puts into a fresh store, then `n` gets, in batches.
fn store_round(
    dir: &Path,
    objects: &[AlignedBuf],
    keys: &[String],
    o: &Opts,
    side: &mut Side,
) -> std::io::Result<()> {
    let path = dir.join("store");
    let len = o.object_bytes;
    let rec = record_bytes(len);
    let segment = (256u64 << 20).max(rec);
    let budget = (rec * objects.len() as u64).div_ceil(segment) * segment + 2 * segment;
    let mut store = DiskStore::open_with(&path, budget, segment, Seal::Checksum, make_io(o)?)?;
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .zip(objects)
        .map(|(k, b)| (k.as_str(), &b[..len as usize]))
        .collect();
    let t = Instant::now();
    for batch in items.chunks(o.batch) {
        let t1 = Instant::now();
        for r in store.put_many(batch) {
            assert!(r?, "a fresh store stores each object");
        }
        side.write_ns
            .push((t1.elapsed().as_nanos() as u64, batch.len()));
    }
    side.write_gbps
        .push(gbps(rec * objects.len() as u64, t.elapsed()));
    // Touched before the clock starts, as the pool's memory is.
    let mut dsts: Vec<AlignedBuf> = (0..o.batch)
        .map(|_| {
            let mut d = AlignedBuf::zeroed(len as usize);
            d.fill(1);
            d
        })
        .collect();
    // The clock runs during the gets only: the bench's own comparison of
    // what came back with what went in is not the store's time.
    let mut busy = std::time::Duration::ZERO;
    for (b, batch) in items.chunks(o.batch).enumerate() {
        let t1 = Instant::now();
        let mut gets: Vec<Get<'_>> = batch
            .iter()
            .zip(dsts.iter_mut())
            .map(|(&(key, _), d)| Get {
                key,
                len,
                dst: &mut d[..len as usize],
            })
            .collect();
        for r in store.get_many(&mut gets) {
            assert!(r?, "the store has each object");
        }
        let took = t1.elapsed();
        busy += took;
        side.read_ns.push((took.as_nanos() as u64, batch.len()));
        drop(gets);
        for (i, d) in dsts.iter().take(batch.len()).enumerate() {
            let want = &objects[b * o.batch + i][..len as usize];
            assert!(
                &d[..len as usize] == want,
                "the store gave back another object"
            );
        }
    }
    side.read_gbps.push(gbps(rec * objects.len() as u64, busy));
    drop(store);
    std::fs::remove_dir_all(path)
}

pub fn run(o: &Opts) {
    let folder = Folder(
        o.dir
            .join(format!("kvring-bench-disk-{}", std::process::id())),
    );
    std::fs::create_dir_all(&folder.0).expect("the run's folder");
    let len = o.object_bytes as usize;
    let rec = record_bytes(o.object_bytes);
    assert!(
        o.batch > 0 && o.queue_depth > 0,
        "a batch and a depth of one at least"
    );
    let objects: Vec<AlignedBuf> = (0..o.objects).map(|i| object(i, len)).collect();
    let io_name = make_io(o).expect("the I/O").name();
    let keys: Vec<String> = (0..o.objects).map(|i| format!("bench:{i:08x}")).collect();
    let (mut raw, mut store) = (Side::default(), Side::default());
    for round in 0..o.rounds {
        let both = |raw: &mut Side, store: &mut Side, raw_first: bool| -> std::io::Result<()> {
            if raw_first {
                raw_round(&folder.0, rec, o.objects, o, raw)?;
                store_round(&folder.0, &objects, &keys, o, store)
            } else {
                store_round(&folder.0, &objects, &keys, o, store)?;
                raw_round(&folder.0, rec, o.objects, o, raw)
            }
        };
        both(&mut raw, &mut store, round % 2 == 0).expect("a round");
        eprintln!(
            "round {round}: raw write {:.2} read {:.2} GB/s; store write {:.2} read {:.2} GB/s",
            raw.write_gbps[round],
            raw.read_gbps[round],
            store.write_gbps[round],
            store.read_gbps[round]
        );
    }
    let ratio = |a: &[f64], b: &[f64]| Side::median(a) / Side::median(b);
    let rings =
        (o.rings_s > 0.0).then(|| crate::disk_rings::measure(&folder.0.join("rings"), o.rings_s));
    let out = json!({
        "bench": "disk",
        "dir": o.dir.display().to_string(),
        "object_bytes": o.object_bytes,
        "record_bytes": rec,
        "objects": o.objects,
        "rounds": o.rounds,
        "queue_depth": o.queue_depth,
        "batch": o.batch,
        "io": io_name,
        "raw": raw.to_json(),
        "store": store.to_json(),
        "ratios": {
            "store_write_over_raw": ratio(&store.write_gbps, &raw.write_gbps),
            "store_read_over_raw": ratio(&store.read_gbps, &raw.read_gbps),
        },
        "rings": rings,
    });
    println!(
        "disk ({io_name}, queue depth {}, batches of {}): {} objects of {} KiB a round, {} rounds: write {:.2} GB/s raw, {:.2} store ({:.2}x); read {:.2} raw, {:.2} store ({:.2}x)",
        o.queue_depth,
        o.batch,
        o.objects,
        o.object_bytes >> 10,
        o.rounds,
        Side::median(&raw.write_gbps),
        Side::median(&store.write_gbps),
        ratio(&store.write_gbps, &raw.write_gbps),
        Side::median(&raw.read_gbps),
        Side::median(&store.read_gbps),
        ratio(&store.read_gbps, &raw.read_gbps),
    );
    if let Some(r) = &rings {
        println!(
            "rings: PING p99 {:.1} us idle, {:.1} us with the disk tier busy ({:.2}x), {:.1} us under the same load without a disk tier",
            r["idle_us"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["disk_busy_us"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["ratios"]["disk_busy_p99_over_idle"].as_f64().unwrap_or(f64::NAN),
            r["load_no_disk_us"]["p99"].as_f64().unwrap_or(f64::NAN),
        );
    }
    if o.json {
        println!("{out}");
    }
}
