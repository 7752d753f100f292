//! A chunk object as the second tier stores it: a value of a 64-byte header
//! and the object's bytes (the pool's layout-independent chunk object).
//!
//! The header binds the object to the key it was written under (a digest
//! of the whole key, prefix included: model, world size, rank, layout
//! fingerprint, salt, chunk hash and this format's version) and to its size,
//! and a seal covers the header and the object: a checksum (XXH3-128), or,
//! where the operator gave the servers a secret, a MAC (keyed BLAKE3). A
//! value that does not open under the key it was read from, with the size
//! that key's format fixes and the seal this server uses, is a miss, never
//! an engine's KV. What each seal protects against: docs/tiers.md, "Trust".
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVRINGL2` |
//! | 8 | 4 | format version, u32 LE ([`FORMAT_VERSION`]) |
//! | 12 | 4 | seal, u32 LE: 1 checksum, 2 MAC ([`Seal`]) |
//! | 16 | 8 | object bytes, u64 LE |
//! | 24 | 16 | key digest: the first 16 bytes of BLAKE3 of the key |
//! | 40 | 8 | zero |
//! | 48 | 16 | the seal of bytes 0..48 and the object: XXH3-128 (LE), or the first 16 bytes of keyed BLAKE3 |
//! | 64 | n | the object |

use std::fmt;
use std::path::Path;

/// The version of this format (in the key too).
pub const FORMAT_VERSION: u32 = 2;
/// `"KVRINGL2"` as a little-endian u64.
const MAGIC: u64 = u64::from_le_bytes(*b"KVRINGL2");
/// Header bytes.
pub const HEADER: usize = 64;
/// Header bytes the seal covers (all but the seal itself).
const SEALED_HEADER: usize = 48;
/// The shortest secret taken for a MAC, in bytes.
pub const MIN_SECRET: usize = 16;
/// What a MAC key is derived from a secret for (BLAKE3's key derivation).
const MAC_CONTEXT: &str = "kvring 2026-12-04 second-tier value MAC";

/// Why a value is not the object its key names.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    #[error("{0} bytes: shorter than the header")]
    Short(usize),
    #[error("not a kvring object (magic {0:#x})")]
    Magic(u64),
    #[error("format version {0}, not {FORMAT_VERSION}")]
    Version(u32),
    #[error("sealed with {found}, where this server takes {expected} only")]
    Seal {
        expected: &'static str,
        found: &'static str,
    },
    #[error("header bytes 40..48 are not zero")]
    Reserved,
    #[error("the header says {said} bytes of object where its key's format has {expected}")]
    Size { expected: u64, said: u64 },
    #[error("{found} bytes of object where the header says {said}")]
    Length { said: u64, found: u64 },
    #[error("a value of {found} bytes where its key's format makes {expected} (not read)")]
    ValueSize { expected: u64, found: u64 },
    #[error("written under another key")]
    Key,
    #[error("its {0} does not match")]
    Check(&'static str),
}

/// A MAC key, derived from the operator's secret (never shown).
#[derive(Clone, PartialEq, Eq)]
pub struct MacKey([u8; 32]);

impl fmt::Debug for MacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    /// The key of `secret` (at least [`MIN_SECRET`] bytes).
    pub fn from_secret(secret: &[u8]) -> Result<MacKey, String> {
        if secret.len() < MIN_SECRET {
            return Err(format!(
                "the secret has {} bytes; at least {MIN_SECRET} are needed (e.g. `head -c 32 /dev/urandom | base64`)",
                secret.len()
            ));
        }
        Ok(MacKey(blake3::derive_key(MAC_CONTEXT, secret)))
    }

    /// The key of the secret in file `path`: its bytes, trailing ASCII
    /// whitespace (a newline) left out. A file that others may read is
    /// taken, with a warning.
    pub fn from_file(path: &Path) -> Result<MacKey, String> {
        use std::os::unix::fs::PermissionsExt;
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        if let Ok(md) = std::fs::metadata(path) {
            if md.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "{}: group or others may read the second tier's secret (mode {:o})",
                    path.display(),
                    md.permissions().mode() & 0o777
                );
            }
        }
        MacKey::from_secret(&bytes[..end]).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// How values are sealed, and the only seal a server accepts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Seal {
    /// XXH3-128: catches damage and values under another key, not a writer
    /// who knows this format.
    #[default]
    Checksum,
    /// Keyed BLAKE3 (128 bits): only a writer with the secret makes a value
    /// this server accepts.
    Mac(MacKey),
}

impl Seal {
    fn code(&self) -> u32 {
        match self {
            Seal::Checksum => 1,
            Seal::Mac(_) => 2,
        }
    }

    fn name(code: u32) -> &'static str {
        match code {
            1 => "a checksum",
            2 => "a MAC",
            _ => "an unknown seal",
        }
    }

    fn hasher(&self) -> Hasher {
        match self {
            Seal::Checksum => Hasher::Checksum(Box::default()),
            Seal::Mac(k) => Hasher::Mac(Box::new(blake3::Hasher::new_keyed(&k.0))),
        }
    }
}

/// A seal being computed.
enum Hasher {
    Checksum(Box<xxhash_rust::xxh3::Xxh3>),
    Mac(Box<blake3::Hasher>),
}

impl Hasher {
    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Checksum(h) => h.update(b),
            Hasher::Mac(h) => {
                h.update(b);
            }
        }
    }

    fn finish(self) -> [u8; 16] {
        match self {
            Hasher::Checksum(h) => h.digest128().to_le_bytes(),
            Hasher::Mac(h) => {
                let mut out = [0u8; 16];
                out.copy_from_slice(&h.finalize().as_bytes()[..16]);
                out
            }
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Hasher::Checksum(_) => "checksum",
            Hasher::Mac(_) => "MAC",
        }
    }
}

/// The digest of `key` a header carries.
/// The digest of `key` a value's header carries (bytes 24..40).
pub fn key_digest(key: &str) -> [u8; 16] {
    let mut d = [0u8; 16];
    d.copy_from_slice(&blake3::hash(key.as_bytes()).as_bytes()[..16]);
    d
}

/// Whether `a` and `b` are equal, in time independent of where they differ.
fn same(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a value's header says before anything is checked but its magic
/// and format version: the object's size and the key's digest. For a
/// store that finds values by scanning (the disk tier after a restart);
/// reading one back still goes through [`open`].
pub fn peek(header: &[u8]) -> Option<(u64, [u8; 16])> {
    let header = header.get(..HEADER)?;
    let magic = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    if magic != MAGIC || version != FORMAT_VERSION {
        return None;
    }
    let len = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
    Some((len, header[24..40].try_into().expect("16 bytes")))
}

/// Object `body` as the value of `key`: its header, and the object itself,
/// written straight into a command's argument (no value buffer of its own:
/// a 32 MiB object is copied once, into the command).
pub struct Value<'a> {
    header: [u8; HEADER],
    body: &'a [u8],
}

impl<'a> Value<'a> {
    /// The value of `body` under `key`, sealed with `seal` (one pass over
    /// `body`).
    pub fn seal(key: &str, body: &'a [u8], seal: &Seal) -> Value<'a> {
        let mut header = [0u8; HEADER];
        header[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&seal.code().to_le_bytes());
        header[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
        header[24..40].copy_from_slice(&key_digest(key));
        let mut h = seal.hasher();
        h.update(&header[..SEALED_HEADER]);
        h.update(body);
        header[SEALED_HEADER..].copy_from_slice(&h.finish());
        Value { header, body }
    }

    /// Bytes of the value.
    pub fn len(&self) -> usize {
        HEADER + self.body.len()
    }

    /// Never: a value has its header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The header (what precedes the object in the value).
    pub fn header(&self) -> &[u8; HEADER] {
        &self.header
    }

    /// Writes the value into `dst` (exactly [`Self::len`] bytes).
    pub fn write_into(&self, dst: &mut [u8]) {
        dst[..HEADER].copy_from_slice(&self.header);
        dst[HEADER..].copy_from_slice(self.body);
    }

    /// The value in a buffer of its own.
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.header[..], self.body].concat()
    }
}

impl redis::ToRedisArgs for Value<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        // Into the command's buffer: cannot fail.
        let _ = w.write_all(&self.header);
        let _ = w.write_all(self.body);
    }
}

/// A value whose header names its key, its size and this server's seal;
/// its seal is checked by [`Opened::copy_into`] or [`Opened::check`].
pub struct Opened<'v> {
    head: &'v [u8],
    body: &'v [u8],
    sealed: [u8; 16],
    hasher: Hasher,
}

/// Opens `value`, read from `key`, as an object of `len` bytes sealed with
/// `seal`: every field of its header checked, not yet its seal.
pub fn open<'v>(value: &'v [u8], key: &str, len: u64, seal: &Seal) -> Result<Opened<'v>, BadValue> {
    if value.len() < HEADER {
        return Err(BadValue::Short(value.len()));
    }
    open_parts(&value[..HEADER], &value[HEADER..], key, len, seal)
}

/// [`open`] of a value whose header (`head`, [`HEADER`] bytes) and object
/// (`body`) are not next to each other in memory (a store that keeps the
/// header apart from the object, so the object can be read straight
/// where it goes): the same checks.
pub fn open_parts<'v>(
    head: &'v [u8],
    body: &'v [u8],
    key: &str,
    len: u64,
    seal: &Seal,
) -> Result<Opened<'v>, BadValue> {
    if head.len() != HEADER {
        return Err(BadValue::Short(head.len()));
    }
    let value = head;
    let word = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| u32::from_le_bytes(value[at..at + 4].try_into().expect("4 bytes"));
    let magic = word(0);
    if magic != MAGIC {
        return Err(BadValue::Magic(magic));
    }
    let version = half(8);
    if version != FORMAT_VERSION {
        return Err(BadValue::Version(version));
    }
    let code = half(12);
    if code != seal.code() {
        return Err(BadValue::Seal {
            expected: Seal::name(seal.code()),
            found: Seal::name(code),
        });
    }
    let said = word(16);
    if said != len {
        return Err(BadValue::Size {
            expected: len,
            said,
        });
    }
    if body.len() as u64 != said {
        return Err(BadValue::Length {
            said,
            found: body.len() as u64,
        });
    }
    let digest: [u8; 16] = value[24..40].try_into().expect("16 bytes");
    if digest != key_digest(key) {
        return Err(BadValue::Key);
    }
    if word(40) != 0 {
        return Err(BadValue::Reserved);
    }
    Ok(Opened {
        head: &value[..SEALED_HEADER],
        body,
        sealed: value[SEALED_HEADER..HEADER].try_into().expect("16 bytes"),
        hasher: seal.hasher(),
    })
}

/// Bytes copied, then hashed while still in cache, at a time.
const BLOCK: usize = 256 << 10;

impl<'v> Opened<'v> {
    /// Bytes of the object.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    /// Never: a value's header says how long it is.
    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    fn verdict(self) -> Result<(), BadValue> {
        let what = self.hasher.what();
        if same(&self.hasher.finish(), &self.sealed) {
            Ok(())
        } else {
            Err(BadValue::Check(what))
        }
    }

    /// Copies the object into `dst` (as long) and checks its seal as it
    /// goes: one pass over the object for both. On `Err` the copy is not
    /// the object.
    pub fn copy_into(mut self, dst: &mut [u8]) -> Result<(), BadValue> {
        assert_eq!(
            dst.len(),
            self.body.len(),
            "a destination of the object's size"
        );
        self.hasher.update(self.head);
        for (from, to) in self.body.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
            to.copy_from_slice(from);
            self.hasher.update(from);
        }
        self.verdict()
    }

    /// The object, its seal checked.
    pub fn check(mut self) -> Result<&'v [u8], BadValue> {
        let body = self.body;
        self.hasher.update(self.head);
        self.hasher.update(body);
        self.verdict()?;
        Ok(body)
    }
}

/// The object of `len` bytes in `value`, read from `key`, its header and
/// seal checked.
pub fn decode<'v>(value: &'v [u8], key: &str, len: u64, seal: &Seal) -> Result<&'v [u8], BadValue> {
    open(value, key, len, seal)?.check()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "kvring:v2:00000000000000ab:1:0:0000000000001234:0000000000000000:11111111111111111111111111111111";

    fn mac(secret: &str) -> Seal {
        Seal::Mac(MacKey::from_secret(secret.as_bytes()).unwrap())
    }

    #[test]
    fn an_object_round_trips_and_any_damage_is_caught() {
        let obj: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let n = obj.len() as u64;
        for seal in [Seal::Checksum, mac("sixteen or more bytes")] {
            let v = Value::seal(KEY, &obj, &seal).to_vec();
            // What a command carries is the same bytes, in one argument.
            assert_eq!(
                redis::ToRedisArgs::to_redis_args(&Value::seal(KEY, &obj, &seal)),
                vec![v.clone()]
            );
            assert_eq!(decode(&v, KEY, n, &seal).unwrap(), &obj[..]);
            assert_eq!(
                decode(&v[..v.len() - 1], KEY, n, &seal).unwrap_err(),
                BadValue::Length {
                    said: n,
                    found: n - 1
                }
            );
            assert_eq!(
                decode(&v[..10], KEY, n, &seal).unwrap_err(),
                BadValue::Short(10)
            );
            assert_eq!(
                decode(&v, KEY, n + 1, &seal).unwrap_err(),
                BadValue::Size {
                    expected: n + 1,
                    said: n
                }
            );
            // Every bit of the header and of the object is covered.
            for at in [
                0,
                8,
                12,
                16,
                24,
                39,
                40,
                48,
                63,
                HEADER + 5_000,
                v.len() - 1,
            ] {
                let mut bad = v.clone();
                bad[at] ^= 1;
                assert!(decode(&bad, KEY, n, &seal).is_err(), "bit at {at}");
            }
            let mut flipped = v.clone();
            flipped[HEADER + 5_000] ^= 1;
            assert!(matches!(
                decode(&flipped, KEY, n, &seal),
                Err(BadValue::Check(_))
            ));
            // Read from another key: the same model's neighbour, or the same
            // key under another prefix.
            let other = KEY.replace(":0:", ":1:");
            assert_eq!(decode(&v, &other, n, &seal).unwrap_err(), BadValue::Key);
            assert_eq!(
                decode(&v, &format!("x{KEY}"), n, &seal).unwrap_err(),
                BadValue::Key
            );
            let mut newer = v.clone();
            newer[8] = 3;
            assert_eq!(
                decode(&newer, KEY, n, &seal).unwrap_err(),
                BadValue::Version(3)
            );
        }
    }

    #[test]
    fn a_value_opens_only_under_the_seal_of_its_reader() {
        let obj = vec![9u8; 4096];
        let n = obj.len() as u64;
        let plain = Value::seal(KEY, &obj, &Seal::Checksum).to_vec();
        let ours = Value::seal(KEY, &obj, &mac("the operator's secret")).to_vec();
        let theirs = Value::seal(KEY, &obj, &mac("another secret, same length")).to_vec();
        assert!(matches!(
            decode(&plain, KEY, n, &mac("the operator's secret")),
            Err(BadValue::Seal { .. })
        ));
        assert!(matches!(
            decode(&ours, KEY, n, &Seal::Checksum),
            Err(BadValue::Seal { .. })
        ));
        assert_eq!(
            decode(&theirs, KEY, n, &mac("the operator's secret")).unwrap_err(),
            BadValue::Check("MAC")
        );
        assert!(decode(&ours, KEY, n, &mac("the operator's secret")).is_ok());
        // A short secret is refused, with the size needed.
        assert!(MacKey::from_secret(b"short").unwrap_err().contains("16"));
    }

    #[test]
    fn a_checked_copy_is_the_object_or_an_error() {
        // Longer than a block, not a multiple of one.
        let obj: Vec<u8> = (0..(BLOCK * 2 + 777) as u32)
            .map(|i| (i * 31 + 5) as u8)
            .collect();
        let n = obj.len() as u64;
        for seal in [Seal::Checksum, mac("0123456789abcdef")] {
            let v = Value::seal(KEY, &obj, &seal).to_vec();
            let mut dst = vec![0u8; obj.len()];
            open(&v, KEY, n, &seal)
                .unwrap()
                .copy_into(&mut dst)
                .unwrap();
            assert_eq!(dst, obj);
            let mut flipped = v;
            flipped[HEADER + BLOCK + 3] ^= 0x10;
            assert!(matches!(
                open(&flipped, KEY, n, &seal).unwrap().copy_into(&mut dst),
                Err(BadValue::Check(_))
            ));
        }
    }

    #[test]
    fn a_secret_file_is_read_without_its_trailing_newline() {
        let dir = std::env::temp_dir().join(format!("kvring-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, "a secret of some length\n").unwrap();
        std::fs::write(&b, "a secret of some length").unwrap();
        assert_eq!(
            MacKey::from_file(&a).unwrap(),
            MacKey::from_file(&b).unwrap()
        );
        std::fs::write(&a, "  \n").unwrap();
        assert!(MacKey::from_file(&a).is_err());
        assert!(MacKey::from_file(&dir.join("missing"))
            .unwrap_err()
            .contains("missing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
