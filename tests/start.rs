//! Starts that cannot succeed: the real `kvring serve` refuses a server the
//! machine cannot hold before it creates anything, and a start that fails
//! after creating files removes them again.

mod common;

use common::kvring_bin;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `kvring serve` with `args`, expecting it to fail within 20 s;
/// returns what it printed on stderr.
fn serve_fails(name: &str, dir: &Path, args: &[&str]) -> String {
    let mut child = Command::new(kvring_bin())
        .args(["serve", "--name", name, "--runtime-dir"])
        .arg(dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the server exited cleanly");
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return err;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the server started: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn unique(tag: &str) -> (String, std::path::PathBuf) {
    let name = format!("start-{tag}-{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("kvring-test-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    (name, dir)
}

fn shm_exists(name: &str) -> bool {
    Path::new("/dev/shm")
        .join(kvring::rundir::shm_name(name).trim_start_matches('/'))
        .exists()
}

#[test]
fn a_server_the_machine_cannot_hold_is_refused_before_anything_is_created() {
    let (name, dir) = unique("oversize");
    // A pool of a million GiB.
    let err = serve_fails(
        &name,
        &dir,
        &["--backend", "host", "--pool-bytes", "1048576GiB"],
    );
    assert!(
        err.contains("MemAvailable") && err.contains("--allow-oversize"),
        "{err}"
    );
    assert!(!dir.exists(), "the runtime directory was created");
    // A segment of 4096 clients with 1 GiB rings: 8 TiB.
    let err = serve_fails(
        &name,
        &dir,
        &[
            "--backend",
            "host",
            "--max-clients",
            "4096",
            "--req-ring-bytes",
            "1073741824",
            "--cq-ring-bytes",
            "1073741824",
        ],
    );
    assert!(err.contains("/dev/shm") && err.contains("free"), "{err}");
    assert!(!dir.exists());
    assert!(!shm_exists(&name));
}

#[test]
fn a_start_that_fails_after_creating_files_removes_them() {
    let (name, dir) = unique("late");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    // The socket's path is taken by a directory: binding fails after the
    // lock file and the segment were created.
    let sock = dir.join(format!("{name}.sock"));
    std::fs::create_dir(&sock).unwrap();
    let err = serve_fails(&name, &dir, &["--backend", "host", "--pool-bytes", "8MiB"]);
    assert!(err.contains("bind"), "{err}");
    assert!(
        !dir.join(format!("{name}.lock")).exists(),
        "the lock file stayed"
    );
    assert!(!shm_exists(&name), "the segment stayed");
    assert!(sock.is_dir(), "what was not the server's is left alone");
    std::fs::remove_dir_all(&dir).unwrap();
    // Into a runtime directory that did not exist: it goes too. (CUDA with
    // simulated devices fails once the lock is taken: without a GPU when
    // CUDA is opened, with one when the devices are counted.)
    let (name, dir) = unique("nodir");
    let err = serve_fails(
        &name,
        &dir,
        &[
            "--backend",
            "cuda",
            "--simulated-devices",
            "2",
            "--pool-bytes",
            "8MiB",
        ],
    );
    assert!(err.to_lowercase().contains("cuda"), "{err}");
    assert!(!dir.exists(), "the runtime directory stayed: {err}");
}
