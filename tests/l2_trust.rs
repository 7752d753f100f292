//! What others write into the second tier never becomes an engine's KV
//! unless it is bound to its key: against real Valkey, values copied from
//! another model, swapped between chunks, forged in the previous format or
//! sealed without the servers' secret are misses, counted, and an engine's
//! retrieved bytes are always its own (every hit checked byte for byte);
//! a wrong-typed key is a miss, not a tier down; an oversized value is
//! refused before it is read whole.

mod common;

use common::tier::*;
use common::valkey::Valkey;
use common::*;
use kvring::kv::{model_id, ChunkHash};
use kvring::proto::kv::TierState;
use kvring_server::l2::value::{self, MacKey, Seal, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The one key in `vk` of chunk `h` of `model`.
fn key_of_model(vk: &Valkey, model: &str, h: &ChunkHash) -> String {
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    let keys = vk.keys(&format!("kvring:v2:{:016x}:*:{hex}", model_id(model)));
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys[0].clone()
}

/// The object bytes of a value.
fn object_len(v: &[u8]) -> u64 {
    (v.len() - value::HEADER) as u64
}

/// A value in the previous format (magic, version 1, length, XXH3-64 of
/// the object), as a writer who knows it, or a server of that version,
/// writes it.
fn previous_format(body: &[u8]) -> Vec<u8> {
    let mut v = b"KVRINGL2".to_vec();
    v.extend(1u32.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend((body.len() as u64).to_le_bytes());
    v.extend(xxhash_rust::xxh3::xxh3_64(body).to_le_bytes());
    v.extend(body);
    v
}

/// Bytes an attacker would like an engine to compute on.
fn attackers_kv(len: u64) -> Vec<u8> {
    (0..len).map(|i| (i * 13 + 7) as u8).collect()
}

/// Asserts that chunk `h` alone is a miss on `e`'s server, counted as
/// corrupt, with the tier still up and no command failed.
fn refused(e: &mut Engine, h: &ChunkHash, what: &str) {
    let before = stats(e);
    assert_eq!(
        fetch_and_check(e, std::slice::from_ref(h)),
        0,
        "{what}: a hit"
    );
    let s = stats(e);
    assert_eq!(
        s.l2_corrupt_objects,
        before.l2_corrupt_objects + 1,
        "{what}: not counted: {s:?}"
    );
    assert_eq!(
        (s.tier_state(), s.l2_errors),
        (Ok(TierState::Up), before.l2_errors),
        "{what}: {s:?}"
    );
}

/// A 0600 file holding `secret`, removed on drop.
struct SecretFile(PathBuf);

impl SecretFile {
    fn new(tag: &str, secret: &str) -> SecretFile {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let p = std::env::temp_dir().join(format!("kvring-secret-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
            .unwrap();
        writeln!(f, "{secret}").unwrap();
        SecretFile(p)
    }

    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn values_not_bound_to_their_key_are_misses() {
    let vk = Valkey::start("l2t-bind");
    let a = server("l2t-bind-a", &[vk.url()], &["--l2-write", "through"]);
    let mut ea = engine(&a);
    let hashes = store(&mut ea, 60, 8);
    // Another model stores the same prompt (same chunk hashes, same layout
    // and object size, other bytes).
    let mut other = Engine::of_model(&a, "another-model", small_layout(), 1, 0);
    let blocks = other.blocks(0, 8);
    other.write(&hashes, &blocks);
    assert_eq!(other.store(0, &hashes, &blocks).value, 8);
    until(&mut ea, "written through", |s| s.l2_written_objects == 16);
    let k: Vec<String> = hashes.iter().map(|h| key_of_model(&vk, MODEL, h)).collect();
    let get = |i: usize| vk.get_raw(&k[i]).unwrap();
    // Chunk 1: the other model's value of the same chunk, copied here.
    let foreign = vk
        .get_raw(&key_of_model(&vk, "another-model", &hashes[1]))
        .unwrap();
    assert_ne!(foreign, get(1));
    vk.set_raw(&k[1], &foreign);
    // Chunks 2 and 3: two genuine values of this prompt, swapped.
    let (v2, v3) = (get(2), get(3));
    vk.set_raw(&k[2], &v3);
    vk.set_raw(&k[3], &v2);
    // Chunk 5: an attacker's KV in the previous format, well formed.
    let len = object_len(&get(5));
    vk.set_raw(&k[5], &previous_format(&attackers_kv(len)));

    let b = server("l2t-bind-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    // The prefix ends at the first value not bound to its key; what was
    // retrieved is the engine's own, byte for byte.
    assert_eq!(fetch_and_check(&mut eb, &hashes), 1);
    for (i, what) in [
        (1, "another model's value"),
        (2, "a swapped value"),
        (3, "the other swapped value"),
        (5, "an attacker's value in the previous format"),
    ] {
        refused(&mut eb, &hashes[i], what);
    }
    // The untouched values are served, each on its own.
    for i in [4, 6, 7] {
        assert_eq!(fetch_and_check(&mut eb, &hashes[i..=i]), 1, "chunk {i}");
    }
    assert_eq!(stats(&mut eb).l2_errors, 0);
}

#[test]
fn a_secret_makes_a_value_only_its_holders_can_write() {
    let secret = SecretFile::new("l2t-mac", "the operators' secret, shared by the servers");
    let vk = Valkey::start("l2t-mac");
    let a = server(
        "l2t-mac-a",
        &[vk.url()],
        &["--l2-write", "through", "--l2-secret-file", secret.arg()],
    );
    let mut ea = engine(&a);
    let hashes = store(&mut ea, 61, 6);
    until(&mut ea, "written through", |s| s.l2_written_objects == 6);
    // A server with the same secret takes them all.
    let b = server(
        "l2t-mac-b",
        &[vk.url()],
        &["--l2-secret-file", secret.arg()],
    );
    let mut eb = engine(&b);
    assert_eq!(fetch_and_check(&mut eb, &hashes), 6);
    assert_eq!(stats(&mut eb).l2_corrupt_objects, 0);
    // One without it takes none (and one with another secret neither).
    let c = server("l2t-mac-c", &[vk.url()], &[]);
    let mut ec = engine(&c);
    assert_eq!(fetch_and_check(&mut ec, &hashes), 0);
    assert!(stats(&mut ec).l2_corrupt_objects >= 1);
    let wrong = SecretFile::new("l2t-mac-wrong", "a guess at the operators' secret");
    let d = server("l2t-mac-d", &[vk.url()], &["--l2-secret-file", wrong.arg()]);
    let mut ed = engine(&d);
    assert_eq!(fetch_and_check(&mut ed, &hashes), 0);
    assert!(stats(&mut ed).l2_corrupt_objects >= 1);

    // A writer who knows the format, not the secret: its values are bound
    // to their keys, well formed, and taken by a server without a secret;
    // sealed with a checksum or with a MAC of another key, they are misses
    // here.
    let k: Vec<String> = hashes.iter().map(|h| key_of_model(&vk, MODEL, h)).collect();
    let len = object_len(&vk.get_raw(&k[0]).unwrap());
    let theirs = attackers_kv(len);
    let by_checksum = Value::seal(&k[2], &theirs, &Seal::Checksum).to_vec();
    assert_eq!(
        value::decode(&by_checksum, &k[2], len, &Seal::Checksum).unwrap(),
        &theirs[..]
    );
    vk.set_raw(&k[2], &by_checksum);
    let guessed = Seal::Mac(MacKey::from_secret(b"a guess at the operators' secret").unwrap());
    vk.set_raw(&k[3], &Value::seal(&k[3], &theirs, &guessed).to_vec());
    // And a genuine value, swapped.
    vk.set_raw(&k[4], &vk.get_raw(&k[5]).unwrap());
    let e = server(
        "l2t-mac-e",
        &[vk.url()],
        &["--l2-secret-file", secret.arg()],
    );
    let mut ee = engine(&e);
    assert_eq!(fetch_and_check(&mut ee, &hashes), 2);
    refused(&mut ee, &hashes[2], "sealed with a checksum");
    refused(&mut ee, &hashes[3], "sealed with another key");
    refused(&mut ee, &hashes[4], "a genuine value under another key");
    assert_eq!(fetch_and_check(&mut ee, &hashes[5..]), 1);
}

#[test]
fn values_of_the_previous_format_are_misses_not_errors() {
    let vk = Valkey::start("l2t-old");
    let (_a, _ea, hashes) = stored_through(&vk, "l2t-old-a", 62, 3);
    let k: Vec<String> = hashes.iter().map(|h| key_of(&vk, h)).collect();
    let len = object_len(&vk.get_raw(&k[0]).unwrap());
    // What a server of the previous version left: its own keys (`v1`).
    for key in &k {
        vk.set_raw(
            &key.replacen(":v2:", ":v1:", 1),
            &previous_format(&attackers_kv(len)),
        );
    }
    // And such a value under a key of this version.
    vk.set_raw(&k[1], &previous_format(&attackers_kv(len)));
    let b = server("l2t-old-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    assert_eq!(fetch_and_check(&mut eb, &hashes), 1);
    let s = stats(&mut eb);
    assert_eq!(
        (s.l2_corrupt_objects, s.l2_errors, s.tier_state()),
        (1, 0, Ok(TierState::Up)),
        "{s:?}"
    );
}

#[test]
fn a_wrong_typed_key_is_a_miss_and_the_tier_stays_up() {
    let vk = Valkey::start("l2t-type");
    let (_a, _ea, hashes) = stored_through(&vk, "l2t-type-a", 63, 4);
    let k2 = key_of(&vk, &hashes[2]);
    let mut c = vk.client();
    let _: () = redis::cmd("DEL").arg(&k2).query(&mut c).unwrap();
    let _: () = redis::cmd("RPUSH")
        .arg(&k2)
        .arg("a")
        .arg("b")
        .query(&mut c)
        .unwrap();
    let b = server("l2t-type-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    let mut errors = 0;
    for round in 0..5 {
        // Chunks 0 and 1 come from the tier (the first time) or the pool.
        assert_eq!(fetch_and_check(&mut eb, &hashes), 2, "round {round}");
        let s = stats(&mut eb);
        assert_eq!(
            s.tier_state(),
            Ok(TierState::Up),
            "round {round}: the tier went down: {s:?}"
        );
        assert!(
            s.l2_errors > errors,
            "round {round}: the reply not counted: {s:?}"
        );
        errors = s.l2_errors;
    }
    // The chunk after it is served on its own, and another prompt whole.
    assert_eq!(fetch_and_check(&mut eb, &hashes[3..]), 1);
    let (_a2, _ea2, more) = stored_through(&vk, "l2t-type-c", 64, 4);
    assert_eq!(fetch_and_check(&mut eb, &more), 4);
    assert_eq!(stats(&mut eb).tier_state(), Ok(TierState::Up));
}

/// `field` of `/proc/PID/status`, in KiB.
fn status_kib(pid: i32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

#[test]
fn an_oversized_value_is_refused_before_it_is_read_whole() {
    const BIG: u64 = 256 << 20;
    let vk = Valkey::start("l2t-big");
    let (_a, _ea, hashes) = stored_through(&vk, "l2t-big-a", 65, 3);
    let k1 = key_of(&vk, &hashes[1]);
    let big = Value::seal(&k1, &attackers_kv(BIG), &Seal::Checksum).to_vec();
    vk.set_raw(&k1, &big);
    drop(big);
    let b = server("l2t-big-b", &[vk.url()], &[]);
    let mut eb = engine(&b);
    let pid = b.srv.pid();
    let before = status_kib(pid, "VmHWM:");
    let t = Instant::now();
    assert_eq!(fetch_and_check(&mut eb, &hashes), 1);
    let took = t.elapsed();
    let grew_mib = status_kib(pid, "VmHWM:").saturating_sub(before) / 1024;
    let s = stats(&mut eb);
    println!(
        "a lookup past a {} MiB value: {took:?}, the server's peak resident memory +{grew_mib} MiB, {} value bytes read",
        BIG >> 20,
        s.l2_bytes_in
    );
    assert_eq!(s.l2_corrupt_objects, 1, "{s:?}");
    // Read: at most one byte past what the object's value has, per value.
    let len = object_len(&vk.get_raw(&key_of(&vk, &hashes[0])).unwrap());
    assert!(
        s.l2_bytes_in <= 3 * (value::HEADER as u64 + len + 1),
        "{s:?}"
    );
    assert!(
        grew_mib < 32,
        "the server's peak memory grew {grew_mib} MiB"
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
}
