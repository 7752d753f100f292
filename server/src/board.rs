//! The cache service's board: the words of the segment where it publishes
//! what observers read (the inspector, `/metrics`, `/healthz`): the cache's
//! counters in the header and each client's registered caches in its
//! block. Only the server writes them; every store is Relaxed, as each word
//! is read on its own and no reader concludes anything from the order in
//! which two of them were written (no load pairs with these stores).

use kvring::proto::kv::StatsReply;
use kvring::segment::Mapping;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the cache service writes into the segment; it keeps the mapping
/// alive for as long as it may write.
pub(crate) struct Board(Arc<Mapping>);

impl Board {
    pub(crate) fn new(mapping: Arc<Mapping>) -> Board {
        Board(mapping)
    }

    /// Copies the cache's counters into the header.
    pub(crate) fn publish(&self, stats: &StatsReply) {
        let words: [u64; kvring::shm::CACHE_STATS_WORDS] = bytemuck::cast(*stats);
        for (a, w) in self.0.header().cache_stats.iter().zip(words) {
            a.store(w, Ordering::Relaxed);
        }
    }

    /// The KV caches client slot `slot` has registered.
    pub(crate) fn set_instances(&self, slot: u32, n: u32) {
        self.0
            .server_client(slot)
            .kv_instances
            .store(n, Ordering::Relaxed);
    }
}
