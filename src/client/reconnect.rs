//! Reconnecting after the server went away: a new connection to the server
//! of the same name (a restarted one), and every KV cache this client had
//! registered registered again with it.
//!
//! The client keeps what each registration sent (spec, layout, memory
//! tables, and duplicates of its descriptors). [`Registration`] handles the
//! engine holds stay usable: one registered with an earlier server is sent
//! as the id the current server gave the same registration.

use super::registration::{KvSpec, Registration};
use super::{connect, Client, ClientOptions};
use crate::error::{Error, Result};
use crate::kv::KvLayout;
use crate::proto::kv::{MemKind, RegisterTables};
use crate::proto::Status;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// One registration, as sent, to send again.
pub(crate) struct Saved {
    pub key: u64,
    pub spec: KvSpec,
    pub layout: Arc<KvLayout>,
    pub mem_kind: MemKind,
    pub tables: RegisterTables,
    pub fds: Vec<OwnedFd>,
    /// The current server's id for it.
    pub id: u32,
}

impl Saved {
    pub fn new(
        spec: &KvSpec,
        layout: Arc<KvLayout>,
        mem_kind: MemKind,
        tables: RegisterTables,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Saved> {
        // Unique in this process, so a Registration of one client is never
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
            layout,
            mem_kind,
            tables,
            fds,
            id: 0,
        })
    }
}

impl Client {
    /// Connects again to the server of this name (normally a new server
    /// after the old one died: waits for it until `deadline`), and registers
    /// again every KV cache this client has registered. Requests in flight
    /// on the old connection are dropped. Ids of the old server's jobs and
    /// leases read `Unknown` through this client from now on; `Job` and
    /// `Lease` handles of the old connection answer `ClientClosed` (their
    /// connection is gone), and their queued releases are dropped. Returns
    /// how many caches were registered again (the [`Registration`] handles
    /// keep working).
    ///
    /// When a registration is refused by the new server (another chunk
    /// size, say), the others are still registered and the first refusal is
    /// returned; the refused cache is no longer registered.
    pub fn reconnect(&mut self, deadline: Instant) -> Result<usize> {
        let mut opts: ClientOptions = self.opts.clone();
        opts.connect_timeout = deadline.saturating_duration_since(Instant::now());
        let mut fresh = connect::connect(&self.paths, &opts)?;
        fresh.opts = self.opts.clone();
        fresh.releases = self.releases.clone();
        let saved = std::mem::take(&mut self.registrations);
        // The old connection says goodbye (harmless when its server is gone).
        *self = fresh;
        let mut n = 0;
        let mut first_err = None;
        for mut s in saved {
            match self.send_registration(&s) {
                Ok((id, _)) => {
                    n += 1;
                    s.id = id;
                    self.registrations.push(s);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// The id the current server knows `reg` by.
    pub(crate) fn server_instance(&self, reg: &Registration) -> Result<u32> {
        // Registered on this connection: its id as given. Otherwise (after
        // a reconnect, to a new server or the same one) the id this
        // connection registered the same memory under.
        if reg.link_id == self.link.id {
            return Ok(reg.id);
        }
        self.registrations
            .iter()
            .find(|s| s.key == reg.key)
            .map(|s| s.id)
            .ok_or(Error::Status(Status::UnknownInstance))
    }
}
