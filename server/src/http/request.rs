//! The request reader: a request from the bytes of a connection, however
//! they are split. It does no I/O, so its answer is a function of the
//! bytes received (the `http_request` fuzz target checks it).

use super::{Response, REQUEST_LIMIT};

/// What the endpoint reads of a request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    /// The client accepts OpenMetrics (Prometheus asks for it).
    pub(crate) openmetrics: bool,
    /// The credentials of an `Authorization: Bearer` header.
    pub(crate) bearer: Option<Vec<u8>>,
    /// The body, when the request had a `Content-Length`.
    pub(crate) body: Option<Vec<u8>>,
}

/// What a [`RequestReader`] says after the bytes it was given.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Step {
    /// More bytes are needed (at most [`RequestReader::room`]).
    More,
    /// The headers are in, and the client waits for `100 Continue` before
    /// it sends its body (curl does for bodies over 1 KiB): send it, then
    /// read on. Said once at most.
    SendContinue,
    /// The request, or the answer that refuses it.
    Done(Result<Request, Response>),
}

/// Reads a request from the bytes of a connection as they arrive, in any
/// split: headers, then a body of `Content-Length` bytes, all of it within
/// [`REQUEST_LIMIT`]. It does no I/O (the connection's task does), so what
/// it answers depends on the bytes only, never on how they were split: the
/// headers are parsed from the bytes received so far (never past the
/// limit) until they are whole, then kept.
#[derive(Default)]
pub(crate) struct RequestReader {
    buf: Vec<u8>,
    head: Option<Head>,
    continued: bool,
}

/// A request's head, once its headers are whole.
struct Head {
    /// The request, without its body.
    request: Request,
    /// The head's length: where the body starts.
    len: usize,
    /// The body's length, when it has one (`Content-Length`).
    body_len: Option<usize>,
    /// The client waits for `100 Continue` before its body.
    expect_continue: bool,
}

impl RequestReader {
    /// How many more bytes this reader takes: one past the limit at most,
    /// which it refuses.
    pub(crate) fn room(&self) -> usize {
        (REQUEST_LIMIT + 1).saturating_sub(self.buf.len())
    }

    /// The bytes the request takes (head and body), once its head is read.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn request_len(&self) -> Option<usize> {
        self.head.as_ref().map(|h| h.len + h.body_len.unwrap_or(0))
    }

    /// Takes the next bytes read (at most [`Self::room`]: the rest is not
    /// looked at); none: the client closed its side.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Step {
        if bytes.is_empty() {
            return Step::Done(Err(Response::text(400, "connection closed mid-request\n")));
        }
        let take = bytes.len().min(self.room());
        self.buf.extend_from_slice(&bytes[..take]);
        if self.head.is_none() {
            match parse_head(&self.buf) {
                Ok(Some(h)) => self.head = Some(h),
                Ok(None) => return Step::More,
                Err(r) => return Step::Done(Err(r)),
            }
        }
        let h = self.head.as_ref().expect("the head was read");
        let Some(body_len) = h.body_len else {
            return Step::Done(Ok(h.request.clone()));
        };
        // (`parse_head` checked that it fits the limit.)
        let end = h.len + body_len;
        if self.buf.len() >= end {
            let mut request = h.request.clone();
            request.body = Some(self.buf[h.len..end].to_vec());
            return Step::Done(Ok(request));
        }
        if h.expect_continue && !self.continued {
            self.continued = true;
            return Step::SendContinue;
        }
        Step::More
    }
}

/// The answer to a request larger than the bound.
fn too_large() -> Response {
    Response::text(
        413,
        &format!("request too large: at most {REQUEST_LIMIT} bytes, headers and body\n"),
    )
}

/// The head of the request whose first bytes are `buf`: none while its
/// headers are not whole, or the answer that refuses it.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, Response> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(&buf[..buf.len().min(REQUEST_LIMIT)]) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > REQUEST_LIMIT => return Err(too_large()),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(Response::text(400, &format!("malformed request: {e}\n"))),
    };
    let header = |name: &'static str| {
        req.headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
    };
    let openmetrics = header("accept")
        .any(|h| String::from_utf8_lossy(h.value).contains("application/openmetrics-text"));
    if header("transfer-encoding").next().is_some() {
        return Err(Response::text(
            400,
            "a body is taken with a Content-Length only (no Transfer-Encoding)\n",
        ));
    }
    let mut body_len: Option<usize> = None;
    for h in header("content-length") {
        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
        let n = (!v.is_empty() && v.bytes().all(|c| c.is_ascii_digit()))
            .then(|| v.parse::<usize>().ok())
            .flatten();
        match (n, body_len) {
            (None, _) => return Err(Response::text(400, "malformed Content-Length\n")),
            (Some(n), Some(m)) if n != m => {
                return Err(Response::text(400, "conflicting Content-Length headers\n"))
            }
            (n, _) => body_len = n,
        }
    }
    if let Some(n) = body_len {
        if len.checked_add(n).is_none_or(|end| end > REQUEST_LIMIT) {
            return Err(too_large());
        }
    }
    let mut auth = header("authorization");
    let bearer = match (auth.next(), auth.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => {
            return Err(Response::text(400, "more than one Authorization header\n"))
        }
        (Some(h), None) => bearer_credentials(h.value).map(<[u8]>::to_vec),
    };
    let expect_continue = header("expect").any(|h| h.value.eq_ignore_ascii_case(b"100-continue"));
    Ok(Some(Head {
        request: Request {
            method: req.method.unwrap_or("").to_string(),
            path: req.path.unwrap_or("").to_string(),
            openmetrics,
            bearer,
            body: None,
        },
        len,
        body_len,
        expect_continue,
    }))
}

/// The credentials of an `Authorization` value of the `Bearer` scheme (in
/// any case), if it is one.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let at = value.iter().position(|c| c.is_ascii_whitespace())?;
    let (scheme, rest) = value.split_at(at);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_credentials_are_the_bearer_schemes_only() {
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"  bEaReR \t abc  "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Bearer"), None);
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        assert_eq!(bearer_credentials(b"abc"), None);
    }
}
