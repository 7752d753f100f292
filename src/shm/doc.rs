//! Every shared struct's fields with offset and size, in declaration order:
//! what `shm_layout.md` must say (checked by `tests/layout_doc.rs`).

use super::*;
use crate::shm_struct::{FieldRow, ShmStruct};

/// `(struct, [(field, offset, size)])` of a struct declared with
/// `shm_struct!`.
fn rows<T: ShmStruct>() -> (&'static str, Vec<FieldRow>) {
    (T::NAME, T::FIELDS.to_vec())
}

/// Every shared struct's fields with offset and size, in declaration order.
#[allow(clippy::type_complexity)]
pub fn field_tables() -> Vec<(&'static str, Vec<FieldRow>)> {
    use crate::jobs::{JobId, JobSlot};
    use crate::kv::{KvGeometry, LayerPlacement};
    use crate::proto::kv::{
        AttachFds, ClearReply, ConfigReply, DescribeRequest, EndSessionRequest, FreeLocksRequest, KvAllocation,
        LookupRequest, MemoryPiece, RegisterKv, RegisterReply, RetrieveRequest, StatsReply,
        StoreRequest, UnregisterKv,
    };
    use crate::proto::{DelayJobRequest, Goodbye, Hello, Welcome};
    use crate::ring::FrameHeader;
    use crate::job_words as w;
    let words = w::WORD_WORKERS as usize * 4;
    vec![
        (
            "JobWordsEntry",
            vec![
                ("go", w::GO, 4),
                ("cancel", w::CANCEL, 4),
                ("landed", w::LANDED, 4),
                ("_reserved", w::LANDED + 4, w::ENTERED - w::LANDED - 4),
                ("entered[32]", w::ENTERED, words),
                ("done[32]", w::DONE, words),
                ("(padding)", w::DONE + words, w::ENTRY_BYTES - w::DONE - words),
            ],
        ),
        rows::<SegmentHeader>(),
        rows::<ServerClientBlock>(),
        rows::<ClientBlock>(),
        rows::<OpStats>(),
        rows::<OpStat>(),
        rows::<LaneStats>(),
        rows::<LaneStat>(),
        rows::<WorkerStat>(),
        rows::<ModelStats>(),
        rows::<ModelStat>(),
        rows::<JobSlot>(),
        rows::<JobId>(),
        rows::<DelayJobRequest>(),
        rows::<KvGeometry>(),
        rows::<LayerPlacement>(),
        rows::<LookupRequest>(),
        rows::<StoreRequest>(),
        rows::<DescribeRequest>(),
        rows::<RetrieveRequest>(),
        rows::<FreeLocksRequest>(),
        rows::<EndSessionRequest>(),
        rows::<ClearReply>(),
        rows::<ConfigReply>(),
        rows::<StatsReply>(),
        rows::<RegisterKv>(),
        rows::<KvAllocation>(),
        rows::<MemoryPiece>(),
        rows::<AttachFds>(),
        rows::<UnregisterKv>(),
        rows::<RegisterReply>(),
        rows::<FrameHeader>(),
        rows::<Hello>(),
        rows::<Welcome>(),
        rows::<Goodbye>(),
    ]
}
