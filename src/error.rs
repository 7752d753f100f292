//! Typed errors for everything a caller of kvring can run into.

use crate::proto::Status;
use crate::ring::RingError;
use std::time::Duration;

/// kvring's error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(
        "invalid server name {0:?}: use 1-64 characters from [A-Za-z0-9_.-], not starting with '.'"
    )]
    InvalidName(String),
    #[error("runtime directory {path}: {reason}")]
    RuntimeDir { path: String, reason: String },
    #[error("segment {name}: not a kvring segment (magic {found:#018x})")]
    NotKvring { name: String, found: u64 },
    #[error("segment {name}: layout version {found}, this build understands version {expected}")]
    LayoutVersion {
        name: String,
        found: u32,
        expected: u32,
    },
    #[error("segment {name}: not initialised yet (layout version not published)")]
    NotReady { name: String },
    #[error("segment {name}: truncated: {len} bytes, but {expected} are needed")]
    Truncated {
        name: String,
        len: u64,
        expected: u64,
    },
    #[error("segment {name}: owned by uid {owner}, not by this user (uid {me})")]
    WrongOwner { name: String, owner: u32, me: u32 },
    #[error("segment {name}: inconsistent layout table: {reason}")]
    BadTable { name: String, reason: String },
    #[error("a kvring server named {name} is already running (pid {pid})")]
    AlreadyRunning { name: String, pid: u32 },
    #[error("shared memory object {name} exists but is not a kvring segment; not replacing it")]
    NotOurs { name: String },
    #[error("no kvring server named {name} at {path}: {reason}")]
    NoServer {
        name: String,
        path: String,
        reason: String,
    },
    #[error("the server refused the connection: {0}")]
    Refused(Status),
    #[error("the server is gone (its process exited or closed the connection)")]
    ServerGone,
    /// A handle was used after its client closed (the server reclaimed
    /// what the connection held).
    #[error("the client this handle belongs to was closed")]
    ClientClosed,
    /// A wait reached its deadline; the span is how long it waited.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the server answered {0}")]
    Status(Status),
    /// A status code this library does not know (a newer server's), kept
    /// as sent.
    #[error("the server answered status code {0}, unknown to this library")]
    UnknownStatus(i32),
    /// An argument the library refuses before sending anything (a block
    /// list that does not match the chunks, a delay beyond the bound, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A synchronous request while other requests wait for their
    /// completions (completions arrive in order: consume them first).
    #[error(
        "synchronous {op:?} while {in_flight} requests are in flight; consume their completions first"
    )]
    CallInFlight {
        op: crate::proto::Opcode,
        in_flight: usize,
    },
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("registration refused ({status}): {reason}")]
    Registration { status: Status, reason: String },
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A job this call waited on failed (a lookup, say).
    #[error("the job failed: {0}")]
    JobFailed(crate::jobs::FailReason),
    #[error("job table: {0}")]
    JobTable(#[from] crate::jobs::ReadError),
    /// The client gave a job up, but one of its copies was still under way
    /// after the give-up's bound (`client::QUIESCE_BOUND`): its blocks may
    /// still change; do not reuse them.
    #[error("{0} was given up while one of its copies was still under way")]
    CopiesInFlight(crate::jobs::JobId),
}

/// kvring's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error for a nonzero status code: `Status` when this library knows
/// the code, `UnknownStatus` (the raw code) when it does not.
pub(crate) fn status(code: i32) -> Error {
    match Status::decode(code).ok() {
        Some(s) => Error::Status(s),
        None => Error::UnknownStatus(code),
    }
}

/// Wraps an I/O error with what was being done.
pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// Wraps a nix error with what was being done.
pub(crate) fn nix(context: impl Into<String>) -> impl FnOnce(nix::Error) -> Error {
    let context = context.into();
    move |e| Error::Io {
        context,
        source: std::io::Error::from(e),
    }
}
