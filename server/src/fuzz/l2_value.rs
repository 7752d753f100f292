//! The second tier's value decoder against any bytes under any key.

use super::Input;

/// The second tier's value decoder against any bytes under any key, and
/// against a value sealed here and then damaged in one byte: a value is
/// taken only if it is exactly what sealing its object under the key it
/// was read from gives (so no bytes but a sealer's can pass), copying it
/// out agrees with checking it, and one damaged byte is always refused.
pub fn l2_value(data: &[u8]) {
    use crate::l2::value::{self, MacKey, Seal, Value};
    let mut input = Input(data);
    let mode = input.u8();
    let seal = if mode & 1 == 0 {
        Seal::Checksum
    } else {
        Seal::Mac(MacKey::from_secret(b"the fuzz target's secret").expect("a secret"))
    };
    let key_len = usize::from(input.u8() % 128);
    let key = String::from_utf8_lossy(input.bytes(key_len)).into_owned();
    let at = input.u32();
    let flip = input.u8() | 1;
    let said = input.u64();
    let rest = input.0;
    // Any bytes, as read from the tier, for the size they have and for a
    // size the input names.
    for len in [rest.len().saturating_sub(value::HEADER) as u64, said] {
        let opened = value::open(rest, &key, len, &seal);
        let checked = value::decode(rest, &key, len, &seal);
        assert_eq!(
            opened.is_ok(),
            checked.is_ok() || matches!(checked, Err(value::BadValue::Check(_)))
        );
        if let Ok(body) = checked {
            assert_eq!(
                Value::seal(&key, body, &seal).to_vec(),
                rest,
                "taken, yet not sealed here"
            );
        }
        if let Ok(o) = value::open(rest, &key, len, &seal) {
            let mut dst = vec![0u8; o.len()];
            assert_eq!(o.copy_into(&mut dst).is_ok(), checked.is_ok());
        }
    }
    // A value sealed here opens, and any one byte of it damaged does not.
    let body = rest;
    let mut v = Value::seal(&key, body, &seal).to_vec();
    let n = body.len() as u64;
    assert_eq!(
        value::decode(&v, &key, n, &seal).expect("a sealed value"),
        body
    );
    let i = at as usize % v.len();
    v[i] ^= flip;
    assert!(
        value::decode(&v, &key, n, &seal).is_err(),
        "byte {i} damaged, yet taken"
    );
    // Under another key, or with the other seal, it is refused whole.
    v[i] ^= flip;
    assert!(value::decode(&v, &format!("{key}x"), n, &seal).is_err());
    let other = match seal {
        Seal::Checksum => {
            Seal::Mac(MacKey::from_secret(b"the fuzz target's secret").expect("a secret"))
        }
        Seal::Mac(_) => Seal::Checksum,
    };
    assert!(value::decode(&v, &key, n, &other).is_err());
}
