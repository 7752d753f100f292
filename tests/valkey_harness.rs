//! The Valkey harness of `tests/common/valkey.rs` against the real
//! `valkey-server` (`$KVRING_VALKEY_SERVER`; `tools/ensure-valkey.sh`
//! installs one): a standalone server stores, reads and scans; SIGSTOP
//! makes a read with a short timeout time out and SIGCONT lets it answer
//! again; a killed server restarts on the same port; a three-master
//! cluster takes keys from a cluster connection and spreads them over all
//! three nodes, and a killed node restarts and rejoins. Without a binary
//! these tests fail (they never pass silently).

mod common;

use common::valkey::{valkey_server, Valkey, ValkeyCluster};
use common::watchdog;
use std::time::{Duration, Instant};

#[test]
fn binary_is_found_and_runs() {
    let _w = watchdog(Duration::from_secs(30));
    let bin = valkey_server();
    let out = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("run {} --version: {e}", bin.display()));
    assert!(out.status.success(), "{} --version: {out:?}", bin.display());
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(
        v.contains("v="),
        "{} --version printed {v:?}",
        bin.display()
    );
    eprintln!("{}: {}", bin.display(), v.trim());
}

#[test]
fn standalone_set_get_scan() {
    let _w = watchdog(Duration::from_secs(60));
    let v = Valkey::start("sgs");
    assert!(v.url().starts_with("redis://127.0.0.1:"));
    assert_eq!(v.url(), format!("redis://127.0.0.1:{}", v.port()));
    assert!(v.pid() > 0);
    assert_eq!(v.dbsize(), 0);
    assert_eq!(v.get_raw("absent"), None);

    // Binary values round-trip byte for byte.
    let bytes: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    v.set_raw("kv:blob", &bytes);
    assert_eq!(v.get_raw("kv:blob").as_deref(), Some(&bytes[..]));

    // SCAN finds every key of a pattern (more than one SCAN batch) and no
    // other.
    for i in 0..2500u32 {
        v.set_raw(&format!("kv:{i:05}"), &i.to_le_bytes());
    }
    v.set_raw("other:1", b"x");
    let keys = v.keys("kv:0*");
    assert_eq!(keys.len(), 2500, "SCAN kv:0*");
    assert_eq!(keys[0], "kv:00000");
    assert_eq!(keys[2499], "kv:02499");
    assert_eq!(v.keys("other:*"), vec!["other:1".to_string()]);
    assert_eq!(v.dbsize(), 2502);

    // A connection of the test's own works as well.
    let mut c = v.client();
    let n: i64 = redis::cmd("INCR").arg("counter").query(&mut c).unwrap();
    assert_eq!(n, 1);

    // No persistence: nothing written to the server's directory but its
    // log.
    let files: Vec<String> = std::fs::read_dir(v.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, vec!["valkey.log".to_string()], "{files:?}");
    let dir = v.dir().to_path_buf();
    drop(v);
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn start_with_maxmemory_evicts() {
    let _w = watchdog(Duration::from_secs(60));
    let v = Valkey::start_with(
        "maxmem",
        &["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let mut c = v.client();
    let maxmemory: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory")
        .query(&mut c)
        .unwrap();
    assert_eq!(maxmemory, vec!["maxmemory", &(8 << 20).to_string()]);
    // 32 MiB into an 8 MiB server: the oldest keys are evicted.
    let value = vec![7u8; 64 << 10];
    for i in 0..512 {
        v.set_raw(&format!("big:{i}"), &value);
    }
    let evicted: u64 = v
        .info_field("stats", "evicted_keys")
        .unwrap()
        .parse()
        .unwrap();
    assert!(evicted > 0, "no key evicted");
    assert!(v.dbsize() < 512);
    assert_eq!(v.get_raw("big:511").as_deref(), Some(&value[..]));
}

#[test]
fn pause_makes_reads_time_out_and_resume_answers() {
    let _w = watchdog(Duration::from_secs(60));
    let v = Valkey::start("pause");
    v.set_raw("k", b"before");
    let mut c = v.client();
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();

    v.pause();
    let t = Instant::now();
    let r: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("GET").arg("k").query(&mut c);
    let took = t.elapsed();
    let e = r.expect_err("GET answered by a stopped server");
    assert!(e.is_timeout(), "expected a timeout, got {e:?}");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "timed out after {took:?}"
    );

    v.resume();
    // The timed-out connection may be out of step; a new one answers.
    let mut c = v.client();
    c.set_read_timeout(Some(Duration::from_millis(1000)))
        .unwrap();
    let got: Option<Vec<u8>> = redis::cmd("GET").arg("k").query(&mut c).unwrap();
    assert_eq!(got.as_deref(), Some(&b"before"[..]));

    // Dropping a paused server kills it too.
    let pid = v.pid();
    v.pause();
    drop(v);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "paused server {pid} survived its drop"
    );
}

#[test]
fn kill_and_restart_on_the_same_port() {
    let _w = watchdog(Duration::from_secs(60));
    let mut v = Valkey::start("restart");
    let port = v.port();
    let pid = v.pid();
    v.set_raw("k", b"v");

    v.kill();
    assert!(!v.is_running());
    assert!(
        redis::Client::open(v.url())
            .unwrap()
            .get_connection_with_timeout(Duration::from_millis(500))
            .is_err(),
        "a killed server still accepts connections"
    );

    v.restart();
    assert_eq!(v.port(), port);
    assert_ne!(v.pid(), pid);
    // No persistence: the data is gone, the server answers.
    assert_eq!(v.get_raw("k"), None);
    v.set_raw("k", b"again");
    assert_eq!(v.get_raw("k").as_deref(), Some(&b"again"[..]));

    // A restart of a running server works as well.
    v.restart();
    assert_eq!(v.port(), port);
    assert_eq!(v.dbsize(), 0);
}

#[test]
fn cluster_spreads_keys_over_three_nodes() {
    let _w = watchdog(Duration::from_secs(120));
    let mut cl = ValkeyCluster::start("cluster");
    eprintln!("cluster formed in {:?}", cl.formed_in());
    assert_eq!(cl.len(), 3);
    let urls = cl.urls();
    assert_eq!(urls.len(), 3);
    for (i, u) in urls.iter().enumerate() {
        assert_eq!(u, &format!("redis://127.0.0.1:{}", cl.node(i).port()));
    }

    let mut c = cl.cluster_client();
    for i in 0..300u32 {
        redis::cmd("SET")
            .arg(format!("kv:{i}"))
            .arg(i.to_le_bytes().as_slice())
            .query::<()>(&mut c)
            .unwrap();
    }
    for i in (0..300u32).step_by(37) {
        let got: Vec<u8> = redis::cmd("GET")
            .arg(format!("kv:{i}"))
            .query(&mut c)
            .unwrap();
        assert_eq!(got, i.to_le_bytes());
    }
    let per_node = cl.keys_per_node();
    eprintln!("keys per node: {per_node:?}");
    assert_eq!(per_node.iter().sum::<usize>(), 300);
    assert!(
        per_node.iter().all(|&n| n > 50),
        "300 keys not spread over all three nodes: {per_node:?}"
    );
    assert_eq!(cl.keys("kv:*").len(), 300);

    // A node that answers nothing times a read of its slots out; resumed,
    // it answers.
    let key_on_1 = (0..300)
        .map(|i| format!("kv:{i}"))
        .find(|k| cl.node_for_key(k) == 1)
        .unwrap();
    assert!(cl.node(1).get_raw(&key_on_1).is_some());
    assert!(cl.node(1).keys("kv:*").contains(&key_on_1));
    let mut c = cl.cluster_client_with_timeout(Duration::from_millis(300));
    cl.node(1).pause();
    {
        let t = Instant::now();
        let r: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("GET").arg(&key_on_1).query(&mut c);
        assert!(r.is_err(), "a paused node answered: {r:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
    cl.node(1).resume();
    assert!(cl.node(1).get_raw(&key_on_1).is_some());

    // A killed node restarts with its node file on its ports and rejoins:
    // its slots are served again (empty: no persistence).
    let t = Instant::now();
    cl.node_mut(2).kill();
    cl.node_mut(2).restart();
    cl.wait_ok(Duration::from_secs(30));
    eprintln!(
        "node 2 restarted and the cluster ok again in {:?}",
        t.elapsed()
    );
    let mut c = cl.cluster_client();
    for i in 0..300u32 {
        redis::cmd("SET")
            .arg(format!("kv2:{i}"))
            .arg(i)
            .query::<()>(&mut c)
            .unwrap();
    }
    let per_node = cl.keys_per_node();
    assert!(per_node[2] > 50, "{per_node:?}");
}
