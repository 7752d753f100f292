//! The main job, as a new user runs it: `kvring demo --json` starts a
//! server, two tensor-parallel workers and a scheduler, and must report
//! every retrieved byte verified.

mod common;

use common::watchdog;
use std::time::Duration;

#[test]
fn the_demo_verifies_every_byte_and_reports_json() {
    let _w = watchdog(Duration::from_secs(120));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvring"))
        .args(["demo", "--json"])
        .output()
        .expect("run kvring demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().expect("output");
    let v: serde_json::Value = serde_json::from_str(last).expect("JSON on the last line");
    assert_eq!(v["verified"], true, "{last}");
    let retrieved = v["retrieve"]["bytes"].as_u64().unwrap();
    assert!(retrieved > 0);
    assert_eq!(v["verified_bytes"].as_u64().unwrap(), retrieved);
    // Stored prompts hit fully, prompts sharing the system prompt hit it.
    assert_eq!(v["lookup"]["hit_chunks"].as_u64().unwrap(), 8 * 8 + 8 * 4);
    for op in ["store", "lookup", "retrieve"] {
        assert!(v[op]["p50_us"].as_f64().unwrap() > 0.0, "{op}");
    }
    assert!(stdout.contains("verified: true"));
}
