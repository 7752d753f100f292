//! Attaching to segments that are not what they should be: each a clear
//! error, and nothing is overwritten.

mod common;

use common::*;
use kvring::segment::ReadOnlySegment;
use kvring::shm::LAYOUT_VERSION;
use kvring::Error;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use std::time::Duration;

/// The bytes of a real server's published segment.
fn real_segment_bytes(s: &Scope) -> Vec<u8> {
    let mut cfg = kvring_server::ServerConfig::new(&s.name);
    cfg.runtime_dir = s.dir.clone();
    cfg.geometry.max_clients = 2;
    cfg.geometry.job_slots = 16;
    let srv = kvring_server::start(cfg).unwrap();
    let bytes = std::fs::read(format!("/dev/shm{}", s.shm_name())).unwrap();
    srv.stop();
    bytes
}

fn write_shm(shm_name: &str, bytes: &[u8]) {
    let _ = nix::sys::mman::shm_unlink(shm_name);
    let fd = nix::sys::mman::shm_open(
        shm_name,
        OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL,
        Mode::S_IRUSR | Mode::S_IWUSR,
    )
    .unwrap();
    nix::unistd::write(&fd, bytes).unwrap();
}

fn shm_bytes(s: &Scope) -> Vec<u8> {
    std::fs::read(format!("/dev/shm{}", s.shm_name())).unwrap()
}

#[test]
fn another_layout_version_is_refused() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("ver");
    let mut bytes = real_segment_bytes(&s);
    bytes[8..12].copy_from_slice(&(LAYOUT_VERSION + 1).to_le_bytes());
    write_shm(&s.shm_name(), &bytes);
    match ReadOnlySegment::open(&s.name) {
        Err(
            e @ Error::LayoutVersion {
                found, expected, ..
            },
        ) => {
            assert_eq!((found, expected), (LAYOUT_VERSION + 1, LAYOUT_VERSION));
            assert!(e.to_string().contains("layout version"), "{e}");
        }
        Err(e) => panic!("expected LayoutVersion, got {e}"),
        Ok(_) => panic!("attached to a segment of another layout version"),
    }
    assert_eq!(shm_bytes(&s), bytes, "the segment was modified");
}

#[test]
fn an_unpublished_segment_is_not_attached() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("unpub");
    let mut bytes = real_segment_bytes(&s);
    bytes[8..12].copy_from_slice(&0u32.to_le_bytes());
    write_shm(&s.shm_name(), &bytes);
    assert!(matches!(
        ReadOnlySegment::open(&s.name),
        Err(Error::NotReady { .. })
    ));
}

#[test]
fn a_truncated_segment_is_refused() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("trunc");
    let bytes = real_segment_bytes(&s);
    for len in [bytes.len() - 4096, 4096, 100] {
        write_shm(&s.shm_name(), &bytes[..len]);
        match ReadOnlySegment::open(&s.name) {
            Err(Error::Truncated {
                len: l, expected, ..
            }) => {
                assert_eq!(l, len as u64);
                assert!(expected > l);
            }
            Err(e) => panic!("len {len}: expected Truncated, got {e}"),
            Ok(_) => panic!("len {len}: attached to a truncated segment"),
        }
        assert_eq!(shm_bytes(&s), &bytes[..len]);
    }
}

#[test]
fn a_bad_region_table_is_refused() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("table");
    let mut bytes = real_segment_bytes(&s);
    // jobs_off at offset 120 moved by one page.
    let off = u64::from_le_bytes(bytes[120..128].try_into().unwrap()) + 4096;
    bytes[120..128].copy_from_slice(&off.to_le_bytes());
    write_shm(&s.shm_name(), &bytes);
    assert!(matches!(
        ReadOnlySegment::open(&s.name),
        Err(Error::BadTable { .. })
    ));
}

#[test]
fn a_foreign_object_is_refused_and_never_replaced() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("foreign");
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13) as u8).collect();
    write_shm(&s.shm_name(), &bytes);
    match ReadOnlySegment::open(&s.name) {
        Err(e @ Error::NotKvring { .. }) => assert!(e.to_string().contains("not a kvring segment")),
        Err(e) => panic!("expected NotKvring, got {e}"),
        Ok(_) => panic!("attached to a foreign object"),
    }
    // A server of that name refuses to start rather than replace it.
    let out = s.serve_output();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a kvring segment; not replacing it"),
        "{err}"
    );
    assert_eq!(shm_bytes(&s), bytes, "the foreign object was modified");
}

#[test]
fn a_segment_owned_by_another_user_is_refused() {
    let _w = watchdog(Duration::from_secs(30));
    if kvring::rundir::euid() != 0 {
        eprintln!("skipped: creating a file owned by another user needs root");
        return;
    }
    let s = Scope::new("owner");
    let bytes = real_segment_bytes(&s);
    write_shm(&s.shm_name(), &bytes);
    let path = format!("/dev/shm{}", s.shm_name());
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    match ReadOnlySegment::open(&s.name) {
        Err(Error::WrongOwner {
            owner: 65534,
            me: 0,
            ..
        }) => {}
        Err(e) => panic!("expected WrongOwner, got {e}"),
        Ok(_) => panic!("attached to another user's segment"),
    }
    let out = s.serve_output();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("owned by uid 65534"));
    assert_eq!(shm_bytes(&s), bytes);
}

#[test]
fn a_stale_segment_of_a_dead_server_is_replaced() {
    let _w = watchdog(Duration::from_secs(30));
    let s = Scope::new("stale");
    let bytes = real_segment_bytes(&s);
    let old_epoch = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
    // A copy of a published segment that nobody holds the lock of: stale.
    write_shm(&s.shm_name(), &bytes);
    let ro = ReadOnlySegment::open(&s.name).unwrap();
    assert!(!ro.server_alive().unwrap());
    let _srv = s.server(&[]);
    let now = ReadOnlySegment::open(&s.name).unwrap();
    assert!(now.server_alive().unwrap());
    assert!(now.view().info().epoch > old_epoch);
    // The old mapping still reads the old, dead segment.
    assert_eq!(ro.view().info().epoch, old_epoch);
}
