//! The HTTP endpoint's request reader against any bytes, in any split.

use super::Input;

/// What the HTTP request reader made of a stream of bytes.
#[derive(Debug)]
struct HttpOutcome {
    result: Result<crate::http::Request, u16>,
    /// How many times it asked for `100 Continue`.
    continues: usize,
    /// The bytes the request took, when it was read whole.
    len: Option<usize>,
    /// The bytes it was given.
    fed: usize,
}

/// Reads `stream` with a fresh reader, each read at most `next_len()`
/// bytes (and the reader's room); the end of `stream` is the client
/// closing its side.
fn read_http(stream: &[u8], mut next_len: impl FnMut() -> usize) -> HttpOutcome {
    use crate::http::{RequestReader, Step};
    let mut r = RequestReader::default();
    let (mut at, mut continues) = (0, 0);
    loop {
        let room = r.room();
        assert!(room > 0, "the reader wants more bytes but has no room");
        let n = next_len().clamp(1, room).min(stream.len() - at);
        let step = r.push(&stream[at..at + n]);
        at += n;
        match step {
            Step::More => {}
            Step::SendContinue => continues += 1,
            Step::Done(result) => {
                return HttpOutcome {
                    result: result.map_err(|resp| resp.code()),
                    continues,
                    len: r.request_len(),
                    fed: at,
                }
            }
        }
    }
}

/// The values of the `Content-Length` headers of a request head, found
/// without the reader's parser: each line after the first, split at its
/// first colon.
fn content_lengths(head: &[u8]) -> Vec<String> {
    head.split(|&c| c == b'\n')
        .skip(1)
        .filter_map(|line| {
            let colon = line.iter().position(|&c| c == b':')?;
            let (name, value) = line.split_at(colon);
            name.eq_ignore_ascii_case(b"content-length").then(|| {
                String::from_utf8_lossy(&value[1..])
                    .trim_end_matches('\r')
                    .trim()
                    .to_string()
            })
        })
        .collect()
}

/// The HTTP endpoint's request reader over any bytes: the first eight are
/// a seed (how the rest is split into reads, and whether it is repeated to
/// run past the request bound), the rest the bytes a client sends before
/// it closes its side. Read in one piece, in the seed's pieces and (when
/// short) byte by byte, the answer is the same; a request read is within
/// `REQUEST_LIMIT` (the endpoint's bound) and its body is exactly the
/// bytes its `Content-Length` says, right after its head; `100 Continue`
/// is asked for once at most; a refusal is 400 or 413.
pub fn http_request(data: &[u8]) {
    use crate::http::REQUEST_LIMIT;
    let mut inp = Input(data);
    let mut seed = inp.u64() | 1;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let rest = inp.0;
    // Repeated up to about twice the bound, at times, to reach it.
    let repeats = match next() % 8 {
        0 if !rest.is_empty() => (2 * REQUEST_LIMIT / rest.len()).clamp(1, 4096),
        _ => 1,
    };
    let stream = rest.repeat(repeats);
    let whole = read_http(&stream, || usize::MAX);
    let pieces = read_http(&stream, || match next() % 4 {
        0 => 1 + (next() % 4096) as usize,
        _ => 1 + (next() % 64) as usize,
    });
    assert_eq!(whole.result, pieces.result, "split into pieces");
    assert_eq!(whole.len, pieces.len);
    if stream.len() <= 512 {
        let bytes = read_http(&stream, || 1);
        assert_eq!(whole.result, bytes.result, "byte by byte");
        assert_eq!(whole.len, bytes.len);
    }
    for o in [&whole, &pieces] {
        assert!(o.continues <= 1, "{o:?}");
        assert!(o.fed <= REQUEST_LIMIT + 1, "{o:?}");
    }
    match &whole.result {
        Ok(req) => {
            let len = whole.len.expect("a request read has a length");
            assert!(len <= REQUEST_LIMIT, "a request of {len} bytes");
            assert!(len <= whole.fed && len <= stream.len());
            let body = req.body.as_deref().unwrap_or_default();
            let head = &stream[..len - body.len()];
            assert!(
                head.ends_with(b"\n"),
                "a head of {} bytes ending {:?}",
                head.len(),
                String::from_utf8_lossy(&head[head.len().saturating_sub(16)..])
            );
            let lengths = content_lengths(head);
            match &req.body {
                Some(b) => {
                    assert!(
                        stream[head.len()..len] == b[..],
                        "the body is not the {} bytes after the head",
                        b.len()
                    );
                    assert!(!lengths.is_empty(), "a body without a Content-Length");
                    for l in &lengths {
                        assert_eq!(l.parse::<usize>().ok(), Some(b.len()), "{lengths:?}");
                    }
                }
                None => assert!(lengths.is_empty(), "{lengths:?} and no body"),
            }
        }
        Err(code) => assert!(matches!(code, 400 | 413), "refused with {code}"),
    }
}
