//! Every shared struct's fields with offset and size, in declaration order:
//! what `shm_layout.md` must say (checked by `tests/layout_doc.rs`).

use super::*;
use std::mem::size_of;

/// Size of the field a raw pointer points at, without reading it.
#[doc(hidden)]
pub fn size_of_pointee<T>(_: *const T) -> usize {
    size_of::<T>()
}

/// `(struct, [(field, offset, size)])` for `$t`'s listed fields.
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

/// Every shared struct's fields with offset and size, in declaration order.
#[allow(clippy::type_complexity)]
pub fn field_tables() -> Vec<(&'static str, Vec<(&'static str, usize, usize)>)> {
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
        field_table!(SegmentHeader {
            magic,
            layout_version,
            header_bytes,
            segment_bytes,
            epoch,
            server_pid,
            server_uid,
            server_start_ticks,
            created_unix_ns,
            max_clients,
            job_slots,
            req_ring_bytes,
            cq_ring_bytes,
            max_frame_bytes,
            _reserved0,
            doorbell_off,
            server_clients_off,
            server_client_stride,
            client_blocks_off,
            client_block_stride,
            jobs_off,
            job_stride,
            op_stats_off,
            _reserved1,
            heartbeat_ns,
            server_sleeping,
            server_state,
            clients_connected,
            clients_accepted,
            clients_reclaimed,
            clients_refused,
            jobs_submitted,
            jobs_done,
            jobs_failed,
            jobs_released,
            jobs_refused,
            cache_stats,
            _reserved2,
        }),
        field_table!(DoorbellPage { server_doorbell }),
        field_table!(ServerClientBlock {
            state,
            session,
            pid,
            uid,
            pid_start_ticks,
            connected_unix_ns,
            requests_served,
            requests_rejected,
            disconnect_reason,
            kv_instances,
            completions_posted,
            req_head,
            cq_tail,
            client_doorbell,
        }),
        field_table!(ClientBlock {
            req_tail,
            cq_head,
            client_sleeping,
            heartbeat_ns,
            in_flight,
            credits
        }),
        field_table!(OpStats { ops }),
        field_table!(OpStat {
            count,
            errors,
            hist
        }),
        field_table!(JobSlot {
            seq,
            generation,
            state,
            kind,
            owner_slot,
            owner_session,
            fail_reason,
            _reserved0,
            result_value,
            result_aux,
            progress,
            user_data,
            submitted_ns,
            started_ns,
            finished_ns,
            released_ns,
            _reserved1,
        }),
        field_table!(JobId { epoch, key }),
        field_table!(DelayJobRequest {
            pending_us,
            running_us,
            progress_every_us,
            result_value,
            result_aux,
            fail_reason,
            _reserved,
        }),
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
        field_table!(LookupRequest {
            model_id,
            salt,
            world_size,
            n_chunks
        }),
        field_table!(StoreRequest {
            instance,
            n_chunks,
            salt,
            flags,
            _reserved,
            event
        }),
        field_table!(RetrieveRequest {
            lease,
            instance,
            first_chunk,
            n_chunks,
            skip_tokens,
            flags,
            _reserved,
            event
        }),
        field_table!(FreeLocksRequest {
            lease,
            first_chunk,
            n_chunks
        }),
        field_table!(EndSessionRequest { lease }),
        field_table!(ClearReply { objects, bytes }),
        field_table!(ConfigReply {
            chunk_tokens,
            copy_threads,
            pool_bytes,
            max_request_bytes,
            lease_ttl_ms,
            backend,
            _reserved,
        }),
        field_table!(StatsReply {
            pool_bytes,
            pool_used_bytes,
            objects,
            leases,
            instances,
            lookups,
            lookup_chunks,
            lookup_hit_chunks,
            stores,
            stored_chunks,
            stored_bytes,
            store_no_space_chunks,
            retrieves,
            retrieved_chunks,
            retrieved_bytes,
            evicted_objects,
            evicted_bytes,
            leases_expired,
        }),
        field_table!(RegisterKv {
            magic,
            kind,
            mem_kind,
            model_id,
            world_size,
            rank,
            layout,
            n_tensors,
            _reserved,
            device_uuid,
        }),
        field_table!(CudaRegion {
            ipc_handle,
            offset,
            alloc_bytes,
            fd_index,
            _reserved,
        }),
        field_table!(TensorRegion {
            fd_index,
            _reserved,
            offset
        }),
        field_table!(AttachFds { magic, kind, count }),
        field_table!(UnregisterKv {
            magic,
            kind,
            instance
        }),
        field_table!(RegisterReply {
            magic,
            kind,
            status,
            instance,
            chunk_tokens,
            text,
        }),
        field_table!(FrameHeader {
            len,
            opcode,
            flags,
            session,
            status,
            user_data
        }),
        field_table!(Hello {
            magic,
            kind,
            protocol,
            layout_version,
            _reserved
        }),
        field_table!(Welcome {
            magic,
            kind,
            status,
            protocol,
            layout_version,
            slot,
            session,
            epoch,
            segment_bytes,
            server_pid,
            _reserved,
        }),
        field_table!(Goodbye {
            magic,
            kind,
            _reserved
        }),
    ]
}
