//! The second tier's keys: everything that makes an object distinct, in
//! text, so an operator can read them (`SCAN MATCH kvring:*`). No hash
//! tags: a cluster spreads a prompt's chunks over its slots.

use super::value::FORMAT_VERSION;
use crate::cache::ObjectKey;
use std::fmt::Write;

/// `PREFIX` `v` format `:` model `:` world size `:` rank `:` layout
/// fingerprint `:` salt `:` chunk hash, numbers in hex (the rank `s` for
/// objects every rank shares, MLA's).
pub fn key(prefix: &str, k: &ObjectKey) -> String {
    let world = k.rank_tag >> 16;
    let rank = k.rank_tag & 0xffff;
    let mut s = String::with_capacity(prefix.len() + 112);
    s.push_str(prefix);
    let _ = write!(s, "v{FORMAT_VERSION}:{:016x}:{world:x}:", k.model_id);
    if rank == crate::registry::SHARED_RANK {
        s.push('s');
    } else {
        let _ = write!(s, "{rank:x}");
    }
    let _ = write!(s, ":{:016x}:{:016x}:", k.fingerprint, k.salt);
    for b in k.hash {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_every_part_of_an_object() {
        let k = ObjectKey {
            model_id: 0xab,
            salt: 7,
            fingerprint: 0x1234,
            rank_tag: (4 << 16) | 3,
            hash: [0x11; 16],
        };
        assert_eq!(
            key("kvring:", &k),
            "kvring:v2:00000000000000ab:4:3:0000000000001234:0000000000000007:11111111111111111111111111111111"
        );
        let mut other = k;
        other.rank_tag = (4 << 16) | 2;
        assert_ne!(key("kvring:", &k), key("kvring:", &other));
    }
}
