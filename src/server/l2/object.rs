//! A chunk object as the second tier stores it: a 32-byte header (magic,
//! format version, length, checksum) and the object's bytes, which are the
//! pool's layout-independent chunk object. A value whose header or checksum
//! does not hold is a miss, never wrong KV.

/// The version of this format (in the key too).
pub const FORMAT_VERSION: u32 = 1;
/// `"KVRINGL2"` as a little-endian u64.
const MAGIC: u64 = u64::from_le_bytes(*b"KVRINGL2");
/// Header bytes.
pub const HEADER: usize = 32;

/// Why a value is not an object of this format.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadValue {
    #[error("{0} bytes: shorter than the header")]
    Short(usize),
    #[error("not a kvring object (magic {0:#x})")]
    Magic(u64),
    #[error("format version {0}, not {FORMAT_VERSION}")]
    Version(u32),
    #[error("{found} bytes of object where the header says {said}")]
    Length { said: u64, found: u64 },
    #[error("checksum mismatch")]
    Checksum,
    #[error("{found} bytes of object where its key's format has {expected}")]
    Size { expected: u64, found: u64 },
}

/// Object `body` as a value: its header, and the object itself, written
/// straight into a command's argument (no value buffer of its own: a
/// 32 MiB object is copied once, into the command).
pub struct Value<'a> {
    header: [u8; HEADER],
    body: &'a [u8],
}

impl<'a> Value<'a> {
    pub fn of(body: &'a [u8]) -> Value<'a> {
        let mut header = [0u8; HEADER];
        header[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[16..24].copy_from_slice(&(body.len() as u64).to_le_bytes());
        header[24..32].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(body).to_le_bytes());
        Value { header, body }
    }

    /// Bytes of the value.
    pub fn len(&self) -> usize {
        HEADER + self.body.len()
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

/// The value of object `bytes`, in a buffer of its own.
#[cfg(test)]
pub fn encode(bytes: &[u8]) -> Vec<u8> {
    let v = Value::of(bytes);
    [&v.header[..], v.body].concat()
}

/// The object in `value` and the checksum its header gives, every other
/// field of the header checked; [`copy_checked`] checks the checksum.
pub fn open(value: &[u8]) -> Result<(&[u8], u64), BadValue> {
    if value.len() < HEADER {
        return Err(BadValue::Short(value.len()));
    }
    let word = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().expect("8 bytes"));
    let magic = word(0);
    if magic != MAGIC {
        return Err(BadValue::Magic(magic));
    }
    let version = u32::from_le_bytes(value[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(BadValue::Version(version));
    }
    let (said, sum) = (word(16), word(24));
    let body = &value[HEADER..];
    if body.len() as u64 != said {
        return Err(BadValue::Length {
            said,
            found: body.len() as u64,
        });
    }
    Ok((body, sum))
}

/// Bytes copied, then hashed while still in cache, at a time.
const BLOCK: usize = 256 << 10;

/// Copies `body` into `dst` (as long) and checks its checksum as it goes:
/// one pass over `body` for both. On `Err` the copy is not the object.
pub fn copy_checked(body: &[u8], dst: &mut [u8], sum: u64) -> Result<(), BadValue> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (from, to) in body.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        to.copy_from_slice(from);
        h.update(from);
    }
    if h.digest() == sum {
        Ok(())
    } else {
        Err(BadValue::Checksum)
    }
}

/// The object in `value`, checked.
#[cfg(test)]
pub fn decode(value: &[u8]) -> Result<&[u8], BadValue> {
    let (body, sum) = open(value)?;
    if xxhash_rust::xxh3::xxh3_64(body) != sum {
        return Err(BadValue::Checksum);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_round_trips_and_any_damage_is_caught() {
        let obj: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let v = encode(&obj);
        // What a command carries is the same bytes, in one argument.
        assert_eq!(redis::ToRedisArgs::to_redis_args(&Value::of(&obj)), vec![v.clone()]);
        assert_eq!(decode(&v).unwrap(), &obj[..]);
        assert_eq!(decode(&v[..v.len() - 1]).unwrap_err(), BadValue::Length { said: 10_000, found: 9_999 });
        assert_eq!(decode(&v[..10]).unwrap_err(), BadValue::Short(10));
        let mut flipped = v.clone();
        flipped[HEADER + 5_000] ^= 1;
        assert_eq!(decode(&flipped).unwrap_err(), BadValue::Checksum);
        let mut other = v.clone();
        other[0] = b'X';
        assert!(matches!(decode(&other), Err(BadValue::Magic(_))));
        let mut newer = v.clone();
        newer[8] = 2;
        assert_eq!(decode(&newer).unwrap_err(), BadValue::Version(2));
    }

    #[test]
    fn a_checked_copy_is_the_object_or_an_error() {
        // Longer than a block, not a multiple of one.
        let obj: Vec<u8> = (0..(BLOCK * 2 + 777) as u32).map(|i| (i * 31 + 5) as u8).collect();
        let v = encode(&obj);
        let (body, sum) = open(&v).unwrap();
        let mut dst = vec![0u8; obj.len()];
        copy_checked(body, &mut dst, sum).unwrap();
        assert_eq!(dst, obj);
        let mut flipped = v;
        flipped[HEADER + BLOCK + 3] ^= 0x10;
        let (body, sum) = open(&flipped).unwrap();
        assert_eq!(copy_checked(body, &mut dst, sum).unwrap_err(), BadValue::Checksum);
    }
}
