//! The token ids of described chunks, kept while the pool holds an object
//! of them: what a `BlockStored` carries, and the chunk before (its
//! parent).

use kvring::kv::{chain_seed, chunk_chain, ChainState, ChunkHash};
use std::collections::{HashMap, VecDeque};

/// (model, salt, chunk hash): what token ids are a property of (every
/// rank and layout of a model stores the same chunk of the same tokens).
type Chunk = (u64, u64, ChunkHash);

struct Entry {
    /// The chunk before it in its prompt; `None`: the prompt's first.
    parent: Option<ChunkHash>,
    tokens: Box<[u32]>,
    /// Objects of the chunk the pool holds (as the stream has told them).
    objects: u32,
}

/// Described chunks: those the pool holds objects of, and at most
/// `max_waiting` described and not (yet) stored.
pub(super) struct Tokens {
    chunks: HashMap<Chunk, Entry>,
    /// Chunks described with no object yet, oldest first (some may have
    /// been stored or dropped since: checked when popped).
    waiting: VecDeque<Chunk>,
    max_waiting: usize,
    chunk_tokens: u32,
}

impl Tokens {
    pub(super) fn new(chunk_tokens: u32, max_waiting: usize) -> Tokens {
        Tokens {
            chunks: HashMap::new(),
            waiting: VecDeque::new(),
            max_waiting,
            chunk_tokens,
        }
    }

    /// A DESCRIBE: the chunks of `tokens` after `prev`, their hashes
    /// computed here (so the token ids kept for a hash are the ones it
    /// names, whoever sent them).
    pub(super) fn describe(&mut self, model: u64, salt: u64, prev: ChainState, tokens: &[u32]) {
        let ct = self.chunk_tokens as usize;
        let (hashes, _) = chunk_chain(prev, tokens, self.chunk_tokens);
        let mut parent = (prev != chain_seed()).then(|| prev[..16].try_into().expect("16 bytes"));
        for (hash, toks) in hashes.into_iter().zip(tokens.chunks_exact(ct)) {
            let key = (model, salt, hash);
            if let std::collections::hash_map::Entry::Vacant(v) = self.chunks.entry(key) {
                v.insert(Entry {
                    parent,
                    tokens: toks.into(),
                    objects: 0,
                });
                self.waiting.push_back(key);
            }
            parent = Some(hash);
        }
        while self.waiting.len() > self.max_waiting {
            let old = self.waiting.pop_front().expect("not empty");
            if self.chunks.get(&old).is_some_and(|e| e.objects == 0) {
                self.chunks.remove(&old);
            }
        }
    }

    /// An object of `chunk` became readable: its token ids and parent, if
    /// described.
    pub(super) fn stored(&mut self, chunk: Chunk) -> Option<(Option<ChunkHash>, &[u32])> {
        let e = self.chunks.get_mut(&chunk)?;
        e.objects += 1;
        Some((e.parent, &e.tokens))
    }

    /// An object of `chunk` left the pool: the chunk's token ids go with
    /// its last object.
    pub(super) fn removed(&mut self, chunk: Chunk) {
        if let Some(e) = self.chunks.get_mut(&chunk) {
            e.objects = e.objects.saturating_sub(1);
            if e.objects == 0 {
                self.chunks.remove(&chunk);
            }
        }
    }

    /// A resync: every count starts again from the objects the pool holds
    /// (`stored` is called for each); chunks none of them is of keep their
    /// token ids only as waiting ones.
    pub(super) fn recount(&mut self) {
        for e in self.chunks.values_mut() {
            e.objects = 0;
        }
        self.waiting = self.chunks.keys().copied().collect();
    }

    /// After a resync's `stored` calls: drops the chunks still without
    /// objects beyond the waiting bound.
    pub(super) fn trim(&mut self) {
        let chunks = &self.chunks;
        self.waiting
            .retain(|k| chunks.get(k).is_some_and(|e| e.objects == 0));
        while self.waiting.len() > self.max_waiting {
            let old = self.waiting.pop_front().expect("not empty");
            self.chunks.remove(&old);
        }
    }

    /// Chunks kept (tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvring::kv::chunk_hashes;

    #[test]
    fn token_ids_are_kept_for_the_hash_they_name_while_an_object_holds_them() {
        let prompt: Vec<u32> = (0..40).collect();
        let hashes = chunk_hashes(&prompt, 10);
        let mut t = Tokens::new(10, 8);
        // Chunks 2 and 3, described from the state after chunk 1.
        let (_, state) = chunk_chain(chain_seed(), &prompt[..20], 10);
        t.describe(1, 0, state, &prompt[20..40]);
        assert!(t.stored((1, 0, hashes[0])).is_none(), "never described");
        let (parent, toks) = t.stored((1, 0, hashes[2])).expect("described");
        assert_eq!(parent, Some(hashes[1]));
        assert_eq!(toks, &prompt[20..30]);
        // A second object of the chunk (another rank), then both go.
        assert!(t.stored((1, 0, hashes[2])).is_some());
        t.removed((1, 0, hashes[2]));
        assert!(t.chunks.contains_key(&(1, 0, hashes[2])));
        t.removed((1, 0, hashes[2]));
        assert!(!t.chunks.contains_key(&(1, 0, hashes[2])));
        // Another salt is another chunk.
        assert!(t.stored((1, 5, hashes[3])).is_none());
        // A claimed state that is not the chunk's gives other hashes: the
        // tokens are never kept under a hash they do not name.
        let mut u = Tokens::new(10, 8);
        u.describe(1, 0, chain_seed(), &prompt[20..30]);
        assert!(u.stored((1, 0, hashes[2])).is_none());
    }

    #[test]
    fn chunks_waiting_for_a_store_are_bounded() {
        let prompt: Vec<u32> = (0..1000).collect();
        let mut t = Tokens::new(10, 8);
        t.describe(1, 0, chain_seed(), &prompt);
        assert_eq!(t.len(), 8);
        let hashes = chunk_hashes(&prompt, 10);
        assert!(
            t.stored((1, 0, hashes[99])).is_some(),
            "the newest are kept"
        );
        t.recount();
        t.trim();
        assert_eq!(t.len(), 8);
    }
}
