//! The disk tier with the real `kvring` binary on real files: objects the
//! pool evicts are written to disk and served again, byte for byte; a
//! restarted server serves what the directory holds; a damaged record is a
//! miss, never KV.

mod common;

use common::disk::DiskDir;
use common::tier::*;
use common::valkey::Valkey;
use common::*;
use kvring::proto::kv::TierState;
use std::path::Path;

fn disk_server(tag: &str, dir: &DiskDir, extra: &[&str]) -> Fixture {
    let d = dir.arg();
    let args = [&["--disk", d.as_str(), "--disk-bytes", "16MiB"], extra].concat();
    server(tag, &[], &args)
}

/// A new server for `a` (whose server was killed) on the disk in `dir`.
fn restart_on(a: &mut Fixture, dir: &DiskDir) {
    let d = dir.arg();
    let disk = [
        "--disk",
        d.as_str(),
        "--disk-bytes",
        "16MiB",
        "--http",
        "off",
    ];
    a.restart(&[KV_SERVER_ARGS.as_slice(), &disk].concat());
}

#[test]
fn evicted_objects_are_written_to_disk_and_served_again() {
    let dir = DiskDir::new("disk-back");
    // A 1 MiB pool holds about 30 of the 32 KiB objects.
    let a = disk_server("disk-back", &dir, &["--pool-bytes", "1MiB"]);
    let mut e = engine(&a);
    let first: Vec<_> = (0..16)
        .step_by(4)
        .flat_map(|i| {
            let h = store(&mut e, 10 + i, 4);
            until(&mut e, "queue drained", |s| s.disk_queue == 0);
            h
        })
        .collect();
    for seed in 30..42 {
        store(&mut e, seed, 4);
        until(&mut e, "queue drained", |s| s.disk_queue == 0);
    }
    let s = until(&mut e, "written back", |s| {
        s.disk_written_objects + s.disk_write_dropped_objects == s.evicted_objects
    });
    assert!(s.evicted_objects >= 30, "{s:?}");
    assert_eq!(s.disk_write_dropped_objects, 0, "{s:?}");
    assert_eq!(s.disk_tier_state(), Ok(TierState::Up));
    assert_eq!(s.tier_state(), Ok(TierState::None));
    assert!(!dir.segments().is_empty());
    // The first prompt's chunks left the pool long ago: every byte from disk.
    assert_eq!(fetch_and_check(&mut e, &first[..4]), 4);
    let s = stats(&mut e);
    assert!(
        s.disk_loaded_objects >= 1 && s.lookup_disk_hit_chunks >= 1,
        "{s:?}"
    );
    assert_eq!(s.disk_corrupt_objects, 0, "{s:?}");
}

#[test]
fn a_restarted_server_serves_what_its_disk_holds() {
    let dir = DiskDir::new("disk-restart");
    let mut a = disk_server("disk-restart", &dir, &["--disk-write", "through"]);
    let hashes = {
        let mut e = engine(&a);
        let h = store(&mut e, 20, 8);
        until(&mut e, "written through", |s| s.disk_written_objects == 8);
        h
    };
    a.srv.kill();
    restart_on(&mut a, &dir);
    let mut e = engine(&a);
    assert_eq!(stats(&mut e).objects, 0, "an empty pool");
    assert_eq!(fetch_and_check(&mut e, &hashes), 8);
    assert_eq!(stats(&mut e).disk_loaded_objects, 8);
}

/// Flips one byte of the object of every record slot of the segment at
/// `path` (records of `record` bytes from offset 0, each a header block
/// and then the object).
fn damage(path: &Path, record: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let mut off = 0;
    while off + record <= len {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off + 4096 + 100).unwrap();
        f.write_all_at(&[!b[0]], off + 4096 + 100).unwrap();
        off += record;
    }
    f.sync_all().unwrap();
}

#[test]
fn a_damaged_record_is_a_miss_never_kv() {
    let dir = DiskDir::new("disk-damage");
    let mut a = disk_server("disk-damage", &dir, &["--disk-write", "through"]);
    let hashes = {
        let mut e = engine(&a);
        let h = store(&mut e, 40, 4);
        until(&mut e, "written through", |s| s.disk_written_objects == 4);
        h
    };
    a.srv.kill();
    // 32 KiB objects: a record is a 4 KiB header block and the object.
    for seg in dir.segments() {
        damage(&seg, 9 * 4096);
    }
    restart_on(&mut a, &dir);
    let mut e = engine(&a);
    assert_eq!(fetch_and_check(&mut e, &hashes), 0);
    let s = stats(&mut e);
    assert!(s.disk_corrupt_objects >= 1, "{s:?}");
    assert_eq!(s.disk_loaded_objects, 0, "{s:?}");
}

/// The disk tier in `dir` and the remote tier at `vk`, both written
/// through, for a server's arguments.
fn both_tiers(dir: &DiskDir, vk: &Valkey) -> Vec<String> {
    [
        "--disk",
        &dir.arg(),
        "--disk-bytes",
        "16MiB",
        "--disk-write",
        "through",
        "--l2",
        &vk.url(),
        "--l2-write",
        "through",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_lookup_asks_the_disk_first_then_the_remote_tier_for_the_rest() {
    let vk = Valkey::start("disk-chain");
    // The remote tier has all eight chunks of the prompt...
    let hashes = {
        let (_a, _e, h) = stored_through(&vk, "disk-chain-a", 60, 8);
        h
    };
    // ...the disk its first four, stored by a server with both tiers.
    let dir = DiskDir::new("disk-chain");
    let args = both_tiers(&dir, &vk);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut b = server("disk-chain-b", &[], &args);
    {
        let mut e = engine(&b);
        assert_eq!(store(&mut e, 60, 4), hashes[..4]);
        until(&mut e, "written through to both", |s| {
            s.disk_written_objects == 4 && s.l2_queue == 0
        });
    }
    // A fresh pool: the disk brings the first four, the remote tier the
    // other four, every byte checked.
    b.srv.kill();
    b.restart(
        &[
            KV_SERVER_ARGS.as_slice(),
            args.as_slice(),
            &["--http", "off"],
        ]
        .concat(),
    );
    let mut e = engine(&b);
    assert_eq!(fetch_and_check(&mut e, &hashes), 8);
    let s = stats(&mut e);
    assert_eq!(
        (s.lookup_disk_hit_chunks, s.lookup_l2_hit_chunks),
        (4, 4),
        "{s:?}"
    );
    assert_eq!(
        (s.disk_loaded_objects, s.l2_loaded_objects),
        (4, 4),
        "{s:?}"
    );
    assert_eq!(s.disk_tier_state(), Ok(TierState::Up));
    assert_eq!(s.tier_state(), Ok(TierState::Up));
}

#[test]
fn an_evicted_object_goes_to_every_write_back_tier() {
    let vk = Valkey::start("disk-fanout");
    let dir = DiskDir::new("disk-fanout");
    let d = dir.arg();
    let u = vk.url();
    // A 1 MiB pool holds about 30 of the 32 KiB objects; both tiers
    // written back.
    let a = server(
        "disk-fanout",
        &[u],
        &[
            "--pool-bytes",
            "1MiB",
            "--disk",
            &d,
            "--disk-bytes",
            "16MiB",
        ],
    );
    let mut e = engine(&a);
    let first: Vec<_> = (0..16)
        .step_by(4)
        .flat_map(|i| {
            let h = store(&mut e, 70 + i, 4);
            until(&mut e, "both queues drained", |s| {
                s.disk_queue == 0 && s.l2_queue == 0
            });
            h
        })
        .collect();
    for i in 0..8 {
        store(&mut e, 200 + i, 4);
        until(&mut e, "both queues drained", |s| {
            s.disk_queue == 0 && s.l2_queue == 0
        });
    }
    let s = stats(&mut e);
    assert!(s.evicted_objects >= 16, "{s:?}");
    // Each evicted object went to both tiers; its range came back once
    // both were done with it.
    assert_eq!(
        s.disk_written_objects + s.disk_write_dropped_objects,
        s.evicted_objects,
        "{s:?}"
    );
    assert_eq!(
        s.l2_written_objects + s.l2_write_dropped_objects,
        s.evicted_objects,
        "{s:?}"
    );
    assert!(s.pool_used_bytes <= s.pool_bytes, "{s:?}");
    // The first prompts, long evicted from the pool, come from the disk:
    // the remote tier is not asked.
    let hits: u64 = first.chunks(4).map(|h| fetch_and_check(&mut e, h)).sum();
    let s = stats(&mut e);
    assert!(hits >= 12, "{hits} {s:?}");
    assert!(s.lookup_disk_hit_chunks >= 12, "{s:?}");
    assert_eq!(s.l2_loaded_objects, 0, "{s:?}");
}
