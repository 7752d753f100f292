//! The LRU order: a list threaded through the objects (`prev`, `next`)
//! of the ready, unpinned ones, least recently used first: what eviction
//! walks.

use super::{Cache, ObjState, NIL};

impl Cache {
    pub(super) fn lru_unlink(&mut self, id: u32) {
        let (p, n) = {
            let o = self.obj(id);
            (o.prev, o.next)
        };
        if p == NIL {
            if self.lru_head == id {
                self.lru_head = n;
            }
        } else {
            self.obj_mut(p).next = n;
        }
        if n == NIL {
            if self.lru_tail == id {
                self.lru_tail = p;
            }
        } else {
            self.obj_mut(n).prev = p;
        }
        let o = self.obj_mut(id);
        o.prev = NIL;
        o.next = NIL;
    }

    pub(super) fn lru_push_back(&mut self, id: u32) {
        let tail = self.lru_tail;
        {
            let o = self.obj_mut(id);
            o.prev = tail;
            o.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.obj_mut(tail).next = id;
        }
        self.lru_tail = id;
    }

    /// Whether the object is in the LRU order: ready and not pinned.
    pub(super) fn in_lru(&self, id: u32) -> bool {
        let o = self.obj(id);
        o.state == ObjState::Ready && !o.pinned
    }

    /// Marks a ready object recently used.
    pub(super) fn touch(&mut self, id: u32) {
        if self.in_lru(id) {
            self.lru_unlink(id);
            self.lru_push_back(id);
        }
    }
}
