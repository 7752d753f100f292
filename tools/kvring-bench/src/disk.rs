//! `disk`: the disk tier's store next to the same disk's raw direct I/O,
//! in one run. Each round writes `objects` records of the store's record
//! size to a preallocated file with direct I/O, one after another (queue
//! depth one, as the store writes), and reads them back the same way; and
//! puts the same objects into a fresh store (sealing each, allocating its
//! segments as it goes) and gets them back (each checked against its key
//! and seal, copied out). Rounds alternate which goes first. GB/s per
//! round (median and range over rounds), per-record latency over all
//! rounds, and store over raw.

use crate::stats::{Spread, Summary};
use kvring_server::disk::{record_bytes, AlignedBuf, DiskStore};
use kvring_server::l2::value::Seal;
use serde_json::json;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
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
    write_ns: Vec<u64>,
    read_ns: Vec<u64>,
}

impl Side {
    fn to_json(&self) -> serde_json::Value {
        let s = |v: &[f64]| Spread::of(v).map(|s| s.to_json());
        json!({
            "write_gbps": s(&self.write_gbps),
            "read_gbps": s(&self.read_gbps),
            "write_us": us(&self.write_ns),
            "read_us": us(&self.read_ns),
        })
    }

    fn median(v: &[f64]) -> f64 {
        Spread::of(v).map_or(f64::NAN, |s| s.median)
    }
}

/// Per-record latency in microseconds: p50, p99, min, max.
fn us(ns: &[u64]) -> serde_json::Value {
    let s = Summary::of(ns.to_vec());
    let u = |v: u64| v as f64 / 1e3;
    json!({ "p50": u(s.p50), "p99": u(s.p99), "min": u(s.min), "max": u(s.max), "samples": s.n })
}

fn object(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| {
            (j as u64)
                .wrapping_mul(0x9e37_79b9)
                .wrapping_add(i as u64 * 131) as u8
        })
        .collect()
}

fn gbps(bytes: u64, t: std::time::Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Raw direct I/O of `n` records of `rec` bytes: writes, then reads.
fn raw_round(dir: &Path, rec: u64, n: usize, side: &mut Side) -> std::io::Result<()> {
    let path = dir.join("raw.bin");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    nix::fcntl::posix_fallocate(&f, 0, (rec * n as u64) as libc::off_t)?;
    let mut buf = AlignedBuf::zeroed(rec as usize);
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 7) as u8;
    }
    let t = Instant::now();
    for i in 0..n {
        let t1 = Instant::now();
        f.write_all_at(&buf, i as u64 * rec)?;
        side.write_ns.push(t1.elapsed().as_nanos() as u64);
    }
    side.write_gbps.push(gbps(rec * n as u64, t.elapsed()));
    let t = Instant::now();
    for i in 0..n {
        let t1 = Instant::now();
        f.read_exact_at(&mut buf, i as u64 * rec)?;
        side.read_ns.push(t1.elapsed().as_nanos() as u64);
    }
    side.read_gbps.push(gbps(rec * n as u64, t.elapsed()));
    drop(f);
    std::fs::remove_file(path)
}

/// The store: `n` puts into a fresh store, then `n` gets.
fn store_round(
    dir: &Path,
    objects: &[Vec<u8>],
    keys: &[String],
    side: &mut Side,
) -> std::io::Result<()> {
    let path = dir.join("store");
    let len = objects[0].len() as u64;
    let rec = record_bytes(len);
    let segment = (256u64 << 20).max(rec);
    let budget = (rec * objects.len() as u64).div_ceil(segment) * segment + 2 * segment;
    let mut store = DiskStore::open(&path, budget, segment, Seal::Checksum)?;
    let t = Instant::now();
    for (o, k) in objects.iter().zip(keys) {
        let t1 = Instant::now();
        store.put(k, o)?;
        side.write_ns.push(t1.elapsed().as_nanos() as u64);
    }
    side.write_gbps
        .push(gbps(rec * objects.len() as u64, t.elapsed()));
    let mut dst = vec![0u8; len as usize];
    let t = Instant::now();
    for (o, k) in objects.iter().zip(keys) {
        let t1 = Instant::now();
        let hit = store.get(k, len, &mut dst)?;
        side.read_ns.push(t1.elapsed().as_nanos() as u64);
        assert!(hit && dst == *o, "the store gave back another object");
    }
    side.read_gbps
        .push(gbps(rec * objects.len() as u64, t.elapsed()));
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
    let objects: Vec<Vec<u8>> = (0..o.objects).map(|i| object(i, len)).collect();
    let keys: Vec<String> = (0..o.objects).map(|i| format!("bench:{i:08x}")).collect();
    let (mut raw, mut store) = (Side::default(), Side::default());
    for round in 0..o.rounds {
        let both = |raw: &mut Side, store: &mut Side, raw_first: bool| -> std::io::Result<()> {
            if raw_first {
                raw_round(&folder.0, rec, o.objects, raw)?;
                store_round(&folder.0, &objects, &keys, store)
            } else {
                store_round(&folder.0, &objects, &keys, store)?;
                raw_round(&folder.0, rec, o.objects, raw)
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
        "queue_depth": 1,
        "raw": raw.to_json(),
        "store": store.to_json(),
        "ratios": {
            "store_write_over_raw": ratio(&store.write_gbps, &raw.write_gbps),
            "store_read_over_raw": ratio(&store.read_gbps, &raw.read_gbps),
        },
        "rings": rings,
    });
    println!(
        "disk: {} objects of {} KiB a round, {} rounds: write {:.2} GB/s raw, {:.2} store ({:.2}x); read {:.2} raw, {:.2} store ({:.2}x)",
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
