//! The disk tier with the real `kvring` binary on real files: objects the
//! pool evicts are written to disk and served again, byte for byte; a
//! restarted server serves what the directory holds; a damaged record is a
//! miss, never KV.

mod common;

use common::tier::*;
use common::*;
use kvring::proto::kv::TierState;
use std::path::{Path, PathBuf};

/// A directory for a disk tier, removed at the end of the test.
struct DiskDir(PathBuf);

impl DiskDir {
    fn new(tag: &str) -> DiskDir {
        DiskDir(std::env::temp_dir().join(format!("kvring-{tag}-{}", std::process::id())))
    }

    fn arg(&self) -> String {
        self.0.display().to_string()
    }

    fn segments(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "kvd"))
            .collect();
        v.sort();
        v
    }
}

impl Drop for DiskDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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
            until(&mut e, "queue drained", |s| s.l2_queue == 0);
            h
        })
        .collect();
    for seed in 30..42 {
        store(&mut e, seed, 4);
        until(&mut e, "queue drained", |s| s.l2_queue == 0);
    }
    let s = until(&mut e, "written back", |s| {
        s.l2_written_objects + s.l2_write_dropped_objects == s.evicted_objects
    });
    assert!(s.evicted_objects >= 30, "{s:?}");
    assert_eq!(s.l2_write_dropped_objects, 0, "{s:?}");
    assert_eq!(s.tier_state(), Ok(TierState::Up));
    assert!(!dir.segments().is_empty());
    // The first prompt's chunks left the pool long ago: every byte from disk.
    assert_eq!(fetch_and_check(&mut e, &first[..4]), 4);
    let s = stats(&mut e);
    assert!(
        s.l2_loaded_objects >= 1 && s.lookup_l2_hit_chunks >= 1,
        "{s:?}"
    );
    assert_eq!(s.l2_corrupt_objects, 0, "{s:?}");
}

#[test]
fn a_restarted_server_serves_what_its_disk_holds() {
    let dir = DiskDir::new("disk-restart");
    let mut a = disk_server("disk-restart", &dir, &["--disk-write", "through"]);
    let hashes = {
        let mut e = engine(&a);
        let h = store(&mut e, 20, 8);
        until(&mut e, "written through", |s| s.l2_written_objects == 8);
        h
    };
    a.srv.kill();
    restart_on(&mut a, &dir);
    let mut e = engine(&a);
    assert_eq!(stats(&mut e).objects, 0, "an empty pool");
    assert_eq!(fetch_and_check(&mut e, &hashes), 8);
    assert_eq!(stats(&mut e).l2_loaded_objects, 8);
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
        until(&mut e, "written through", |s| s.l2_written_objects == 4);
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
    assert!(s.l2_corrupt_objects >= 1, "{s:?}");
    assert_eq!(s.l2_loaded_objects, 0, "{s:?}");
}

#[test]
fn a_disk_tier_and_a_remote_tier_together_are_refused_at_start() {
    let dir = DiskDir::new("disk-both");
    let s = Scope::new("disk-both");
    let d = dir.arg();
    let out = std::process::Command::new(kvring_bin())
        .args(["serve", "--name", &s.name, "--runtime-dir"])
        .arg(&s.dir)
        .args([
            "--http",
            "off",
            "--pool-bytes",
            "8MiB",
            "--disk",
            &d,
            "--l2",
            "redis://127.0.0.1:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("disk tier") && err.contains("--l2"), "{err}");
}
