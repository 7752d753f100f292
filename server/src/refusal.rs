//! Why a registration was refused: what the registry, the memory it
//! opens and the copy backends answer a REGISTER they do not take.

/// Why a registration was refused: the status and the text of the reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({status:?})")]
pub struct Refusal {
    pub status: kvring::proto::Status,
    pub reason: String,
}

impl Refusal {
    pub fn new(status: kvring::proto::Status, reason: impl Into<String>) -> Refusal {
        Refusal {
            status,
            reason: reason.into(),
        }
    }

    /// A registration that names something impossible (`InvalidArgument`).
    pub fn invalid(reason: impl Into<String>) -> Refusal {
        Refusal::new(kvring::proto::Status::InvalidArgument, reason)
    }
}
