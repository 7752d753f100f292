//! The pins of the admin routes, in JSON: the body `POST /pin` and `POST
//! /unpin` take, the query `GET /pins` takes and the page it answers.
//! Decoded and encoded through serde; every refusal says what was expected.

use crate::cache::{Pin, PinCount, PinLimits, MAX_PINS_PER_CALL, MAX_PINS_PER_PAGE};
use kvring::kv::ChunkHash;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What `POST /pin` and `POST /unpin` take (said with a refusal).
pub(super) const PIN_BODY: &str = r#"expected a JSON body {"model_id": <u64: a number or a "0x..." hex string>, "salt": <the same; optional, 0>, "hashes": ["<a chunk hash: 32 hex digits>", ...]}"#;

/// What `GET /pins` takes.
pub(super) const PINS_QUERY: &str = "expected GET /pins[?limit=N][&after=CURSOR] (N: 1 to 1000, default 1000; CURSOR: the \"next\" of the page before)";

/// The body of `POST /pin` and `POST /unpin`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PinBody {
    /// (Optional here to say which field is missing.)
    model_id: Option<Word>,
    #[serde(default)]
    salt: Word,
    hashes: Option<Vec<HashText>>,
}

/// A u64 given as a JSON number or a `"0x..."` hex string (JSON numbers
/// past 2^53 lose digits in many clients).
#[derive(Clone, Copy, Default)]
struct Word(u64);

impl<'de> Deserialize<'de> for Word {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Word, D::Error> {
        struct Expect;
        impl Visitor<'_> for Expect {
            type Value = Word;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a u64: a number, or a \"0x...\" hex string of 1 to 16 digits")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Word, E> {
                Ok(Word(v))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Word, E> {
                s.strip_prefix("0x")
                    .or_else(|| s.strip_prefix("0X"))
                    .and_then(hex_u64)
                    .map(Word)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(s), &self))
            }
        }
        d.deserialize_any(Expect)
    }
}

/// A chunk hash in JSON: exactly two hex digits per byte.
#[derive(Deserialize)]
#[serde(try_from = "String")]
struct HashText(ChunkHash);

impl TryFrom<String> for HashText {
    type Error = String;

    fn try_from(s: String) -> Result<HashText, String> {
        hex_hash(&s).map(HashText).ok_or_else(|| {
            let len = ChunkHash::default().len();
            format!(
                "expected a chunk hash of exactly {} hex digits ({len} bytes), got {} characters",
                len * 2,
                s.chars().count()
            )
        })
    }
}

/// The pins a `/pin` or `/unpin` body names, or the status and reason of
/// a refusal (400; 413 past [`MAX_PINS_PER_CALL`] hashes).
pub(super) fn parse_pins(body: Option<&[u8]>) -> Result<Vec<Pin>, (u16, String)> {
    let Some(body) = body else {
        return Err((400, "no body (send it with a Content-Length)".into()));
    };
    let json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| (400, format!("the body is not JSON: {e}")))?;
    if !json.is_object() {
        return Err((400, "the body is not a JSON object".into()));
    }
    let body: PinBody = serde_path_to_error::deserialize(json).map_err(|e| (400, e.to_string()))?;
    let missing = |what: &str| (400, format!("{what} is missing"));
    let model_id = body.model_id.ok_or_else(|| missing("model_id"))?.0;
    let hashes = body.hashes.ok_or_else(|| missing("hashes"))?;
    if hashes.is_empty() {
        return Err((400, "hashes: expected at least one chunk hash".into()));
    }
    if hashes.len() > MAX_PINS_PER_CALL {
        return Err((
            413,
            format!(
                "{} chunk hashes: at most {MAX_PINS_PER_CALL} per call (send more calls)",
                hashes.len()
            ),
        ));
    }
    let salt = body.salt.0;
    Ok(hashes
        .into_iter()
        .map(|HashText(hash)| Pin {
            model_id,
            salt,
            hash,
        })
        .collect())
}

/// The page a `GET /pins` query asks for: after which pin, and how many.
pub(super) fn parse_page(query: &str) -> Result<(Option<Pin>, usize), String> {
    let (mut after, mut limit) = (None, MAX_PINS_PER_PAGE);
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "after" => {
                after = Some(parse_cursor(v).ok_or_else(|| format!("after={v:?}: not a cursor"))?)
            }
            "limit" => {
                limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PINS_PER_PAGE).contains(n))
                    .ok_or_else(|| format!("limit={v:?}: 1 to {MAX_PINS_PER_PAGE}"))?
            }
            _ => return Err(format!("unknown parameter {k:?}")),
        }
    }
    Ok((after, limit))
}

/// One pin as `GET /pins` lists it.
#[derive(Serialize)]
struct PinRow {
    model_id: String,
    salt: String,
    hash: String,
}

/// The answer of `GET /pins`: a page of pins, the cursor of the next one,
/// and the counts and bounds.
#[derive(Serialize)]
pub(super) struct PinsPage {
    pins: Vec<PinRow>,
    next: Option<String>,
    held: u64,
    max_pins: u64,
    pinned_objects: u64,
    pinned_bytes: u64,
    max_pinned_bytes: u64,
    stored_over_bound: u64,
}

impl PinsPage {
    /// `page` (more after it when `more`), with the counts now.
    pub(super) fn new(
        page: &[Pin],
        more: bool,
        now: &PinCount,
        limits: &PinLimits,
        over_bound: u64,
    ) -> PinsPage {
        PinsPage {
            pins: page
                .iter()
                .map(|p| PinRow {
                    model_id: format!("{:#018x}", p.model_id),
                    salt: format!("{:#018x}", p.salt),
                    hash: hex(&p.hash),
                })
                .collect(),
            next: more.then(|| page.last().map(cursor)).flatten(),
            held: now.pins,
            max_pins: limits.max_pins,
            pinned_objects: now.objects,
            pinned_bytes: now.bytes,
            max_pinned_bytes: limits.max_bytes,
            stored_over_bound: over_bound,
        }
    }
}

/// The answer of a `POST /pin` refused whole: why, and the counts and
/// bounds it met.
#[derive(Serialize)]
pub(super) struct PinRefused {
    error: String,
    pins: u64,
    max_pins: u64,
    pinned_bytes: u64,
    max_pinned_bytes: u64,
}

impl PinRefused {
    pub(super) fn new(error: String, now: &PinCount, limits: &PinLimits) -> PinRefused {
        PinRefused {
            error,
            pins: now.pins,
            max_pins: limits.max_pins,
            pinned_bytes: now.bytes,
            max_pinned_bytes: limits.max_bytes,
        }
    }
}

/// Lowercase hex of `b`, in order.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A u64 of 1 to 16 hex digits (no prefix, no sign).
fn hex_u64(digits: &str) -> Option<u64> {
    let ok = (1..=16).contains(&digits.len()) && digits.bytes().all(|c| c.is_ascii_hexdigit());
    ok.then(|| u64::from_str_radix(digits, 16).ok()).flatten()
}

/// A chunk hash of exactly two hex digits per byte.
fn hex_hash(s: &str) -> Option<ChunkHash> {
    let mut h = ChunkHash::default();
    if s.len() != h.len() * 2 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    for (b, pair) in h.iter_mut().zip(s.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).expect("ASCII hex digits");
        *b = u8::from_str_radix(pair, 16).expect("checked hex digits");
    }
    Some(h)
}

/// A pin as a listing's cursor: model, salt and hash in hex, dot-separated.
fn cursor(p: &Pin) -> String {
    format!("{:016x}.{:016x}.{}", p.model_id, p.salt, hex(&p.hash))
}

/// The pin a cursor names.
fn parse_cursor(c: &str) -> Option<Pin> {
    let mut parts = c.split('.');
    let (m, s, h) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || m.len() != 16 || s.len() != 16 {
        return None;
    }
    Some(Pin {
        model_id: hex_u64(m)?,
        salt: hex_u64(s)?,
        hash: hex_hash(h)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(body: &str) -> (u16, String) {
        parse_pins(Some(body.as_bytes())).unwrap_err()
    }

    #[test]
    fn a_body_names_its_pins_in_numbers_or_hex() {
        let h = "00112233445566778899aabbccddeeff";
        let pins = parse_pins(Some(
            format!(
                r#"{{"model_id": "0xff", "salt": 7, "hashes": ["{h}", "{}"]}}"#,
                "f".repeat(32)
            )
            .as_bytes(),
        ))
        .unwrap();
        assert_eq!(pins.len(), 2);
        assert_eq!((pins[0].model_id, pins[0].salt), (255, 7));
        assert_eq!(hex(&pins[0].hash), h);
        assert_eq!(pins[1].hash, [0xff; 16]);
        let no_salt = parse_pins(Some(
            format!(r#"{{"model_id": 1, "hashes": ["{h}"]}}"#).as_bytes(),
        ));
        assert_eq!(no_salt.unwrap()[0].salt, 0);
    }

    #[test]
    fn a_refused_body_says_where_and_what() {
        let h = "00".repeat(16);
        let (code, e) = refusal(&format!(r#"{{"model_id": 1, "hashes": ["{h}", "abc"]}}"#));
        assert_eq!(code, 400);
        assert!(
            e.contains("hashes[1]") && e.contains("32 hex digits"),
            "{e}"
        );
        let (_, e) = refusal(&format!(r#"{{"model_id": "12", "hashes": ["{h}"]}}"#));
        assert!(e.contains("model_id") && e.contains("hex string"), "{e}");
        let (_, e) = refusal(&format!(r#"{{"model_id": -1, "hashes": ["{h}"]}}"#));
        assert!(e.contains("model_id"), "{e}");
        let (_, e) = refusal(&format!(
            r#"{{"model_id": 1, "hashes": ["{h}"], "extra": 1}}"#
        ));
        assert!(e.contains("unknown field"), "{e}");
        let (_, e) = refusal(r#"{"hashes": []}"#);
        assert!(e.contains("model_id"), "{e}");
        let (_, e) = refusal(r#"{"model_id": 1, "hashes": []}"#);
        assert!(e.contains("at least one"), "{e}");
        let (_, e) = refusal(&format!(r#"{{"model_id": 1, "hashes": ["{h}"]}} {{}}"#));
        assert!(e.contains("not JSON"), "{e}");
        let (_, e) = refusal("[1]");
        assert!(e.contains("not a JSON object"), "{e}");
        assert_eq!(parse_pins(None).unwrap_err().0, 400);
        let many: Vec<_> = (0..=MAX_PINS_PER_CALL)
            .map(|_| format!("\"{h}\""))
            .collect();
        let (code, _) = refusal(&format!(
            r#"{{"model_id": 1, "hashes": [{}]}}"#,
            many.join(",")
        ));
        assert_eq!(code, 413);
    }

    #[test]
    fn a_cursor_names_the_pin_it_was_made_of() {
        let p = Pin {
            model_id: 0xdead,
            salt: 3,
            hash: [7; 16],
        };
        assert_eq!(parse_cursor(&cursor(&p)), Some(p));
        let (after, limit) = parse_page(&format!("limit=5&after={}", cursor(&p))).unwrap();
        assert_eq!((after, limit), (Some(p), 5));
        assert!(parse_page("limit=0").is_err());
        assert!(parse_page("after=x.y.z").is_err());
        assert!(parse_page("sort=1").is_err());
    }
}
