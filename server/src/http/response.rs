//! An answer: status, content type and body, and its bytes on the wire.

/// A response: status, content type, body.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Response(u16, &'static str, Vec<u8>);

impl Response {
    /// An answer of `body` as `content_type`.
    pub(super) fn new(code: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response(code, content_type, body)
    }

    /// A plain-text answer.
    pub(super) fn text(code: u16, body: &str) -> Response {
        Response(code, "text/plain; charset=utf-8", body.as_bytes().to_vec())
    }

    /// `v` as JSON.
    pub(super) fn json(code: u16, v: &impl serde::Serialize) -> Response {
        let body = serde_json::to_vec(v).expect("serializable");
        Response(code, "application/json", body)
    }

    /// The status code.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn code(&self) -> u16 {
        self.0
    }

    /// The whole answer: status line, headers, body.
    pub(super) fn to_bytes(&self) -> Vec<u8> {
        let challenge = if self.0 == 401 {
            "WWW-Authenticate: Bearer realm=\"kvring admin\"\r\n"
        } else {
            ""
        };
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\nCache-Control: no-store\r\n{challenge}\r\n",
            self.0,
            reason(self.0),
            self.1,
            self.2.len()
        )
        .into_bytes();
        out.extend_from_slice(&self.2);
        out
    }
}

/// The reason phrase of a status code.
fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}
