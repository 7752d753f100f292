//! The engine's side of the cache: register a KV cache, then LOOKUP (from
//! the scheduler), STORE and RETRIEVE (from each worker) as jobs, and the
//! lease and cache controls.
//!
//! A request larger than one ring frame (a long prompt's hashes, a large
//! block list) is sent as several frames and answered once.

use super::Client;
use crate::error::{Error, Result};
use crate::jobs::JobId;
use crate::kv::{ChunkHash, KvLayout};
use crate::proto::kv::{
    ClearReply, ConfigReply, EndSessionRequest, FreeLocksRequest, LookupRequest, MemKind,
    RegisterKv, RegisterReply, RetrieveRequest, StatsReply, StoreRequest, TensorRegion,
    UnregisterKv, FLAG_EVENT,
};
use crate::proto::{BootKind, Opcode, Status, BOOT_MAGIC};
use crate::ring::{FrameHeader, RingError, FLAG_MORE};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

/// What an engine instance registers.
#[derive(Clone, Copy, Debug)]
pub struct KvSpec {
    /// `kv::model_id(name)`.
    pub model_id: u64,
    /// Tensor-parallel world size and this worker's rank.
    pub world_size: u32,
    pub rank: u32,
    pub layout: KvLayout,
}

/// A registered KV cache, as STORE and RETRIEVE name it.
///
/// It stays usable across [`Client::reconnect`]: the client registers the
/// same memory with the new server and sends the new server's id for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The server's id for it (of the server it was registered with).
    pub id: u32,
    pub layout: KvLayout,
    pub chunk_tokens: u32,
    /// The epoch of the server that gave `id`.
    pub(crate) epoch: u64,
    /// This registration, among every registration of this process.
    pub(crate) key: u64,
}

impl Instance {
    /// Blocks per chunk.
    pub fn blocks_per_chunk(&self) -> u32 {
        self.layout.blocks_per_chunk(self.chunk_tokens)
    }
}

fn payload(header: &impl bytemuck::Pod, parts: &[&[u8]]) -> Vec<u8> {
    let mut v = bytemuck::bytes_of(header).to_vec();
    for p in parts {
        v.extend_from_slice(p);
    }
    v
}

impl Client {
    /// One request of any size up to the server's `max_request_bytes`:
    /// split over frames when it exceeds one, answered once.
    pub fn call_large(&mut self, op: Opcode, payload: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let max = self.max_payload();
        if payload.len() <= max {
            return self.call(op, payload, timeout);
        }
        self.check_no_call_in_flight(op)?;
        let deadline = Instant::now() + timeout;
        let pieces: Vec<&[u8]> = payload.chunks(max).collect();
        let tag = 0x4c52_4745_0000_0000 | op as u64;
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let h = FrameHeader {
                opcode: op as u16,
                flags: if last { 0 } else { FLAG_MORE },
                session: self.session,
                user_data: tag,
                ..Default::default()
            };
            loop {
                let r = if last {
                    self.enqueue(op, piece, tag)
                } else {
                    self.req.write(&h, piece).map_err(Error::from)
                };
                match r {
                    Ok(()) => break,
                    Err(Error::Ring(RingError::Full { .. })) => {
                        // The server drains the ring as we go: publish what
                        // is written and wait for room.
                        self.flush();
                        if Instant::now() > deadline {
                            return Err(Error::Timeout(timeout));
                        }
                        if self.server_gone() {
                            return Err(Error::ServerGone);
                        }
                        std::thread::yield_now();
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        self.flush();
        self.finish_call(op, deadline)
    }

    /// The server's configuration (chunk size, pool, limits).
    pub fn server_config(&mut self) -> Result<ConfigReply> {
        let r = self.call(Opcode::GetConfig, &[], self.opts.call_timeout)?;
        reply_struct(&r)
    }

    /// Registers a KV cache whose tensors are `regions` of the memfds `fds`
    /// (`regions[i].fd_index` indexes `fds`). Host memory must be sealed
    /// against shrinking (see `HostKvCache`). Fails with a clear message
    /// when the layout does not suit the server (a block size that does not
    /// divide the chunk size, a rank out of range, ...).
    pub fn register_kv(
        &mut self,
        spec: &KvSpec,
        regions: &[TensorRegion],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Instance> {
        self.register_memory(
            spec,
            MemKind::HostFd,
            [0; 16],
            bytemuck::cast_slice(regions),
            regions.len(),
            fds,
        )
    }

    /// Registers a KV cache in device memory: `regions` (one per tensor)
    /// name legacy IPC handles (`MemKind::CudaIpc`) or the VMM allocations
    /// whose fds are `fds` (`MemKind::CudaVmmFd`), on the device `uuid`.
    pub fn register_device_kv(
        &mut self,
        spec: &KvSpec,
        kind: MemKind,
        uuid: [u8; 16],
        regions: &[crate::proto::kv::CudaRegion],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Instance> {
        self.register_memory(
            spec,
            kind,
            uuid,
            bytemuck::cast_slice(regions),
            regions.len(),
            fds,
        )
    }

    /// Registers a `CudaKvCache` (see `kvring::client::cuda_cache`).
    #[cfg(feature = "cuda")]
    pub fn register_cuda_cache(
        &mut self,
        model_id: u64,
        world_size: u32,
        rank: u32,
        cache: &crate::client::cuda_cache::CudaKvCache,
    ) -> Result<Instance> {
        let spec = KvSpec {
            model_id,
            world_size,
            rank,
            layout: *cache.layout(),
        };
        let fds: Vec<BorrowedFd<'_>> = cache.fd().into_iter().collect();
        let kind = match cache.export() {
            crate::client::cuda_cache::Export::Ipc => MemKind::CudaIpc,
            crate::client::cuda_cache::Export::VmmFd => MemKind::CudaVmmFd,
        };
        self.register_device_kv(&spec, kind, cache.device_uuid(), &cache.regions(), &fds)
    }

    fn register_memory(
        &mut self,
        spec: &KvSpec,
        mem_kind: MemKind,
        device_uuid: [u8; 16],
        regions: &[u8],
        n_tensors: usize,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Instance> {
        // Kept (with duplicates of the descriptors) to register again after
        // a reconnect.
        let saved =
            super::reconnect::Saved::new(spec, mem_kind, device_uuid, regions, n_tensors, fds)?;
        let inst = self.send_registration(&saved)?;
        self.registrations.push(saved.with_id(inst.id));
        Ok(inst)
    }

    /// Sends one registration and waits for the server's answer.
    pub(super) fn send_registration(
        &mut self,
        saved: &super::reconnect::Saved,
    ) -> Result<Instance> {
        let spec = &saved.spec;
        let fds: Vec<BorrowedFd<'_>> = saved.fds.iter().map(|f| f.as_fd()).collect();
        let chunk_tokens = self.server_config()?.chunk_tokens;
        spec.layout
            .validate(chunk_tokens)
            .map_err(|e| Error::Config(format!("KV layout refused: {e}")))?;
        let max_fds = crate::bootstrap::MAX_FDS;
        let (early, last) = fds.split_at(fds.len() - fds.len().min(max_fds));
        for batch in early.chunks(max_fds) {
            let m = crate::proto::kv::AttachFds {
                magic: BOOT_MAGIC,
                kind: BootKind::AttachFds as u32,
                count: batch.len() as u32,
            };
            self.conn
                .send(bytemuck::bytes_of(&m), batch)
                .map_err(crate::error::io("send descriptors"))?;
        }
        let req = RegisterKv {
            magic: BOOT_MAGIC,
            kind: BootKind::Register as u32,
            mem_kind: saved.mem_kind as u32,
            model_id: spec.model_id,
            world_size: spec.world_size,
            rank: spec.rank,
            layout: spec.layout,
            n_tensors: saved.n_tensors as u32,
            _reserved: 0,
            device_uuid: saved.device_uuid,
        };
        let msg = payload(&req, &[&saved.regions]);
        self.conn
            .send(&msg, last)
            .map_err(crate::error::io("send registration"))?;
        let r = self.boot_reply()?;
        if r.status != 0 {
            return Err(Error::Registration {
                status: Status::from_i32(r.status).unwrap_or(Status::Malformed),
                reason: r.text(),
            });
        }
        Ok(Instance {
            id: r.instance,
            layout: spec.layout,
            chunk_tokens: r.chunk_tokens,
            epoch: self.epoch,
            key: saved.key,
        })
    }

    /// Registers a `HostKvCache`.
    pub fn register_host_cache(
        &mut self,
        model_id: u64,
        world_size: u32,
        rank: u32,
        cache: &super::HostKvCache,
    ) -> Result<Instance> {
        self.register_host_cache_on(model_id, world_size, rank, cache, [0; 16])
    }

    /// Registers a `HostKvCache` of a worker that runs on the device
    /// `device_uuid`: its copies go to that device's copy lane, next to
    /// (never behind) other devices' copies.
    pub fn register_host_cache_on(
        &mut self,
        model_id: u64,
        world_size: u32,
        rank: u32,
        cache: &super::HostKvCache,
        device_uuid: [u8; 16],
    ) -> Result<Instance> {
        let spec = KvSpec {
            model_id,
            world_size,
            rank,
            layout: *cache.layout(),
        };
        let regions = cache.regions();
        self.register_memory(
            &spec,
            MemKind::HostFd,
            device_uuid,
            bytemuck::cast_slice(&regions),
            regions.len(),
            &[cache.fd()],
        )
    }

    /// Unregisters an instance: the server unmaps its memory once copies
    /// in flight have finished.
    pub fn unregister_kv(&mut self, instance: &Instance) -> Result<()> {
        let m = UnregisterKv {
            magic: BOOT_MAGIC,
            kind: BootKind::Unregister as u32,
            instance: self.server_instance(instance)?,
        };
        self.conn
            .send(bytemuck::bytes_of(&m), &[])
            .map_err(crate::error::io("send unregister"))?;
        let r = self.boot_reply()?;
        if r.status != 0 {
            return Err(Error::Registration {
                status: Status::from_i32(r.status).unwrap_or(Status::Malformed),
                reason: r.text(),
            });
        }
        self.registrations.retain(|s| s.key != instance.key);
        Ok(())
    }

    fn boot_reply(&mut self) -> Result<RegisterReply> {
        let mut buf = [0u8; std::mem::size_of::<RegisterReply>() + 8];
        let (n, _fds) = self
            .conn
            .recv(&mut buf, self.opts.call_timeout)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::TimedOut => Error::Timeout(self.opts.call_timeout),
                _ => Error::Io {
                    context: "receive registration reply".into(),
                    source: e,
                },
            })?;
        if n == 0 {
            return Err(Error::ServerGone);
        }
        if n != std::mem::size_of::<RegisterReply>() {
            return Err(Error::Protocol(format!("registration reply of {n} bytes")));
        }
        let r: RegisterReply = bytemuck::pod_read_unaligned(&buf[..n]);
        if r.magic != BOOT_MAGIC || r.kind != BootKind::RegisterReply as u32 {
            return Err(Error::Protocol("not a registration reply".into()));
        }
        Ok(r)
    }

    fn submit_job(&mut self, op: Opcode, payload: &[u8]) -> Result<JobId> {
        let r = self.call_large(op, payload, self.opts.call_timeout)?;
        reply_struct(&r)
    }

    /// LOOKUP: a job whose result value is the number of leading chunks of
    /// `hashes` stored for every rank of `world_size`; it takes read leases
    /// on them (the job id names the lease) for RETRIEVE.
    pub fn lookup(
        &mut self,
        model_id: u64,
        world_size: u32,
        salt: u64,
        hashes: &[ChunkHash],
    ) -> Result<JobId> {
        let h = LookupRequest {
            model_id,
            salt,
            world_size,
            n_chunks: hashes.len() as u32,
        };
        self.submit_job(Opcode::Lookup, &payload(&h, &[hashes.concat().as_slice()]))
    }

    /// STORE: a job copying the blocks of each chunk (`blocks.len()` is
    /// `hashes.len() * blocks_per_chunk`) into the pool. Result value: chunks
    /// present after it; aux: chunks that got no space.
    pub fn store(
        &mut self,
        inst: &Instance,
        salt: u64,
        hashes: &[ChunkHash],
        blocks: &[u32],
    ) -> Result<JobId> {
        self.store_after(inst, salt, hashes, blocks, None)
    }

    /// STORE whose copies wait (on the device) for the CUDA IPC event
    /// `event` that the engine recorded after writing the blocks.
    pub fn store_after(
        &mut self,
        inst: &Instance,
        salt: u64,
        hashes: &[ChunkHash],
        blocks: &[u32],
        event: Option<[u8; 64]>,
    ) -> Result<JobId> {
        check_blocks(inst, hashes.len(), blocks)?;
        let h = StoreRequest {
            instance: self.server_instance(inst)?,
            n_chunks: hashes.len() as u32,
            salt,
            flags: if event.is_some() { FLAG_EVENT } else { 0 },
            _reserved: 0,
            event: event.unwrap_or([0; 64]),
        };
        self.submit_job(
            Opcode::Store,
            &payload(
                &h,
                &[hashes.concat().as_slice(), bytemuck::cast_slice(blocks)],
            ),
        )
    }

    /// RETRIEVE: a job copying chunks `first_chunk ..` of the lookup `lease`
    /// into `blocks` (`n_chunks * blocks_per_chunk` ids), leaving the first
    /// `skip_tokens` tokens (a multiple of the block size) untouched. All or
    /// nothing: fails at once with `NoLease` unless the lease holds every
    /// chunk for this rank.
    pub fn retrieve(
        &mut self,
        inst: &Instance,
        lease: JobId,
        first_chunk: u32,
        blocks: &[u32],
        skip_tokens: u32,
    ) -> Result<JobId> {
        self.retrieve_after(inst, lease, first_chunk, blocks, skip_tokens, None)
    }

    /// RETRIEVE whose copies wait (on the device) for the CUDA IPC event
    /// `event` that the engine recorded once it stopped using the blocks.
    pub fn retrieve_after(
        &mut self,
        inst: &Instance,
        lease: JobId,
        first_chunk: u32,
        blocks: &[u32],
        skip_tokens: u32,
        event: Option<[u8; 64]>,
    ) -> Result<JobId> {
        self.retrieve_flags(inst, lease, first_chunk, blocks, skip_tokens, event, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn retrieve_flags(
        &mut self,
        inst: &Instance,
        lease: JobId,
        first_chunk: u32,
        blocks: &[u32],
        skip_tokens: u32,
        event: Option<[u8; 64]>,
        extra_flags: u32,
    ) -> Result<JobId> {
        let bpc = inst.blocks_per_chunk() as usize;
        if blocks.is_empty() || blocks.len() % bpc != 0 {
            return Err(Error::Config(format!(
                "{} block ids: need a positive multiple of {bpc} (blocks per chunk)",
                blocks.len()
            )));
        }
        let h = RetrieveRequest {
            lease,
            instance: self.server_instance(inst)?,
            first_chunk,
            n_chunks: (blocks.len() / bpc) as u32,
            skip_tokens,
            flags: extra_flags | if event.is_some() { FLAG_EVENT } else { 0 },
            _reserved: 0,
            event: event.unwrap_or([0; 64]),
        };
        self.submit_job(
            Opcode::Retrieve,
            &payload(&h, &[bytemuck::cast_slice(blocks)]),
        )
    }

    /// The handles of this client's job events on device `uuid` (open them
    /// with `kvring::client::cuda_cache::ServerEvents`).
    pub fn job_events(&mut self, uuid: [u8; 16]) -> Result<Vec<[u8; 64]>> {
        let r = self.call(Opcode::JobEvents, &uuid, self.opts.call_timeout)?;
        if r.len() != crate::proto::kv::JOB_EVENTS * 64 {
            return Err(Error::Protocol(format!("{} bytes of job events", r.len())));
        }
        Ok(r.chunks_exact(64)
            .map(|c| c.try_into().expect("64 bytes"))
            .collect())
    }

    /// RETRIEVE that publishes a job event (device memory, CUDA backend):
    /// see [`Client::job_device_event`].
    pub fn retrieve_published(
        &mut self,
        inst: &Instance,
        lease: JobId,
        first_chunk: u32,
        blocks: &[u32],
        skip_tokens: u32,
        event: Option<[u8; 64]>,
    ) -> Result<JobId> {
        self.retrieve_flags(
            inst,
            lease,
            first_chunk,
            blocks,
            skip_tokens,
            event,
            crate::proto::kv::FLAG_PUBLISH_EVENT,
        )
    }

    /// The job event that covers job `id`'s device copies, once they are all
    /// queued: `Some(index)` for the stream to wait on, `None` when the job
    /// already finished (nothing to wait for). A shared-memory poll; ends
    /// with an error if the job fails, `Timeout` at the deadline.
    pub fn job_device_event(&self, id: JobId, deadline: Instant) -> Result<Option<u32>> {
        loop {
            let info = self
                .job_info(id)?
                .ok_or_else(|| Error::Protocol(format!("{id} is not in the job table")))?;
            if info.progress > 0 {
                return Ok(Some((info.progress - 1) as u32));
            }
            match info.status {
                crate::jobs::JobStatus::Done(_) | crate::jobs::JobStatus::Tombstoned(Ok(_)) => {
                    return Ok(None)
                }
                s if s.is_terminal() => return Err(Error::Protocol(format!("{id} ended {s:?}"))),
                _ => {}
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(self.opts.call_timeout));
            }
            if self.server_gone() {
                return Err(Error::ServerGone);
            }
            std::hint::spin_loop();
        }
    }

    /// Ends the lease's holds on chunks `first_chunk .. first_chunk + n`
    /// (u32::MAX: to the end), for chunks that will not be retrieved.
    pub fn free_lookup_locks(&mut self, lease: JobId, first_chunk: u32, n: u32) -> Result<()> {
        let h = FreeLocksRequest {
            lease,
            first_chunk,
            n_chunks: n,
        };
        self.call(
            Opcode::FreeLookupLocks,
            bytemuck::bytes_of(&h),
            self.opts.call_timeout,
        )?;
        Ok(())
    }

    /// Ends a lease (the request is over) and marks its chunks recently used.
    pub fn end_session(&mut self, lease: JobId) -> Result<()> {
        let h = EndSessionRequest { lease };
        self.call(
            Opcode::EndSession,
            bytemuck::bytes_of(&h),
            self.opts.call_timeout,
        )?;
        Ok(())
    }

    /// Drops every stored object not leased or being written.
    pub fn clear(&mut self) -> Result<ClearReply> {
        let r = self.call(Opcode::Clear, &[], self.opts.call_timeout)?;
        reply_struct(&r)
    }

    /// The cache's counters.
    pub fn stats(&mut self) -> Result<StatsReply> {
        let r = self.call(Opcode::Stats, &[], self.opts.call_timeout)?;
        reply_struct(&r)
    }
}

fn check_blocks(inst: &Instance, chunks: usize, blocks: &[u32]) -> Result<()> {
    let want = chunks * inst.blocks_per_chunk() as usize;
    if blocks.len() != want {
        return Err(Error::Config(format!(
            "{} block ids for {chunks} chunks: need {want}",
            blocks.len()
        )));
    }
    Ok(())
}

fn reply_struct<T: bytemuck::Pod>(r: &[u8]) -> Result<T> {
    if r.len() != std::mem::size_of::<T>() {
        return Err(Error::Protocol(format!(
            "reply of {} bytes, expected {}",
            r.len(),
            std::mem::size_of::<T>()
        )));
    }
    Ok(bytemuck::pod_read_unaligned(r))
}
