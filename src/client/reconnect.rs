//! Reconnecting after the server went away: a new connection to the server
//! of the same name (a restarted one), and every KV cache this client had
//! registered registered again with it.
//!
//! The client keeps what each registration sent (spec, tensor table, and
//! duplicates of its descriptors). [`Instance`] values the engine holds stay
//! usable: one registered with an earlier server is sent as the id the
//! current server gave the same registration.

use super::kv::{Instance, KvSpec};
use super::{Client, ClientOptions};
use crate::error::{Error, Result};
use crate::proto::kv::MemKind;
use crate::proto::Status;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One registration, as sent, to send again.
pub(crate) struct Saved {
    pub key: u64,
    pub spec: KvSpec,
    pub mem_kind: MemKind,
    pub device_uuid: [u8; 16],
    pub regions: Vec<u8>,
    pub n_tensors: usize,
    pub fds: Vec<OwnedFd>,
    /// The current server's id for it.
    pub id: u32,
}

impl Saved {
    pub fn new(
        spec: &KvSpec,
        mem_kind: MemKind,
        device_uuid: [u8; 16],
        regions: &[u8],
        n_tensors: usize,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Saved> {
        // Unique in this process, so an Instance of one client is never
        // taken for another's.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let fds = fds
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(crate::error::io("duplicate a registration descriptor"))?;
        Ok(Saved {
            // A counter only: Relaxed.
            key: NEXT.fetch_add(1, Ordering::Relaxed),
            spec: *spec,
            mem_kind,
            device_uuid,
            regions: regions.to_vec(),
            n_tensors,
            fds,
            id: 0,
        })
    }

    pub fn with_id(mut self, id: u32) -> Saved {
        self.id = id;
        self
    }
}

impl Client {
    /// Connects again to the server of this name (normally a new server
    /// after the old one died: waits for it up to `timeout`), and registers
    /// again every KV cache this client has registered. Requests in flight
    /// on the old connection are dropped; job ids of the old server read
    /// `Unknown` from now on. Returns the instances as the new server
    /// numbered them (the old [`Instance`] values keep working).
    ///
    /// When a registration is refused by the new server (another chunk
    /// size, say), the others are still registered and the first refusal is
    /// returned; the refused cache is no longer registered.
    pub fn reconnect(&mut self, timeout: Duration) -> Result<Vec<Instance>> {
        let opts = ClientOptions {
            connect_timeout: timeout,
            ..self.opts.clone()
        };
        let mut fresh = Client::connect_with(&self.paths, &opts)?;
        fresh.opts = self.opts.clone();
        fresh.wait = self.wait;
        let saved = std::mem::take(&mut self.registrations);
        // The old connection says goodbye (harmless when its server is gone).
        *self = fresh;
        let mut out = Vec::with_capacity(saved.len());
        let mut first_err = None;
        for s in saved {
            match self.send_registration(&s) {
                Ok(inst) => {
                    out.push(inst);
                    self.registrations.push(s.with_id(inst.id));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// The id the current server knows `inst` by.
    pub(crate) fn server_instance(&self, inst: &Instance) -> Result<u32> {
        if inst.epoch == self.epoch {
            return Ok(inst.id);
        }
        self.registrations
            .iter()
            .find(|s| s.key == inst.key)
            .map(|s| s.id)
            .ok_or(Error::Status(Status::UnknownInstance))
    }
}
