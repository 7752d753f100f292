//! Every shared struct's fields with offset and size, in declaration order:
//! what `shm_layout.md` must say (checked by `tests/layout_doc.rs`).

use super::*;
use crate::shm_struct::{FieldRow, ShmStruct};
use std::mem::size_of;

/// Size of the field a raw pointer points at, without reading it.
#[doc(hidden)]
pub fn size_of_pointee<T>(_: *const T) -> usize {
    size_of::<T>()
}

/// `(struct, [(field, offset, size)])` for `$t`'s listed fields, for the
/// structs not declared with `shm_struct!`.
#[macro_export]
#[doc(hidden)]
macro_rules! field_table {
    ($t:ty { $($f:ident),* $(,)? }) => {{
        let u = std::mem::MaybeUninit::<$t>::uninit();
        let p = u.as_ptr();
        let fields: Vec<(&'static str, usize, usize)> = vec![$((
            stringify!($f),
            std::mem::offset_of!($t, $f),
            // SAFETY: addr_of! on a field of an uninitialised value computes
            // an address without reading or referencing the value.
            $crate::shm::doc::size_of_pointee(unsafe { std::ptr::addr_of!((*p).$f) }),
        )),*];
        (stringify!($t), fields)
    }};
}

/// `(struct, [(field, offset, size)])` of a struct declared with
/// `shm_struct!`.
fn rows<T: ShmStruct>() -> (&'static str, Vec<FieldRow>) {
    (T::NAME, T::FIELDS.to_vec())
}

/// Every shared struct's fields with offset and size, in declaration order.
#[allow(clippy::type_complexity)]
pub fn field_tables() -> Vec<(&'static str, Vec<FieldRow>)> {
    use crate::jobs::{JobId, JobSlot};
    use crate::kv::KvLayout;
    use crate::proto::kv::{
        AttachFds, ClearReply, ConfigReply, CudaRegion, EndSessionRequest, FreeLocksRequest,
        LookupRequest, RegisterKv, RegisterReply, RetrieveRequest, StatsReply, StoreRequest,
        TensorRegion, UnregisterKv,
    };
    use crate::proto::{DelayJobRequest, Goodbye, Hello, Welcome};
    use crate::ring::FrameHeader;
    vec![
        rows::<SegmentHeader>(),
        rows::<DoorbellPage>(),
        rows::<ServerClientBlock>(),
        rows::<ClientBlock>(),
        rows::<OpStats>(),
        rows::<OpStat>(),
        rows::<JobSlot>(),
        rows::<JobId>(),
        rows::<DelayJobRequest>(),
        // Declared by hand (their files list the fields once more).
        field_table!(KvLayout {
            kind,
            num_layers,
            num_blocks,
            block_tokens,
            num_heads,
            head_dim,
            elem_bytes,
            _reserved,
        }),
        rows::<LookupRequest>(),
        rows::<StoreRequest>(),
        rows::<RetrieveRequest>(),
        rows::<FreeLocksRequest>(),
        rows::<EndSessionRequest>(),
        rows::<ClearReply>(),
        rows::<ConfigReply>(),
        rows::<StatsReply>(),
        rows::<RegisterKv>(),
        rows::<CudaRegion>(),
        rows::<TensorRegion>(),
        rows::<AttachFds>(),
        rows::<UnregisterKv>(),
        rows::<RegisterReply>(),
        rows::<FrameHeader>(),
        rows::<Hello>(),
        rows::<Welcome>(),
        rows::<Goodbye>(),
    ]
}
