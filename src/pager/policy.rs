//! Which slot to evict: least recently used among a class's unpinned slots.
//! Pure bookkeeping, no I/O, so it can be tested (and later replayed) alone.

use super::arena::SlotId;
use std::ops::Range;

/// Least-recently-used order over slots. A slot never used (or freed) has
/// time 0 and is taken first.
#[derive(Clone, Debug)]
pub struct Lru {
    last_use: Vec<u64>,
    clock: u64,
}

impl Lru {
    pub fn new(n_slots: usize) -> Lru {
        Lru { last_use: vec![0; n_slots], clock: 0 }
    }

    /// Records a use of `slot` now.
    pub fn touch(&mut self, slot: SlotId) {
        self.clock += 1;
        self.last_use[slot] = self.clock;
    }

    /// Marks `slot` as holding nothing worth keeping.
    pub fn forget(&mut self, slot: SlotId) {
        self.last_use[slot] = 0;
    }

    /// The least recently used slot in `slots` for which `evictable` holds.
    pub fn victim(&self, slots: Range<SlotId>, evictable: impl Fn(SlotId) -> bool) -> Option<SlotId> {
        slots.filter(|&s| evictable(s)).min_by_key(|&s| self.last_use[s])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_unpinned() {
        let mut lru = Lru::new(4);
        for s in [0, 1, 2, 3] {
            lru.touch(s);
        }
        lru.touch(0);
        assert_eq!(lru.victim(0..4, |_| true), Some(1));
        assert_eq!(lru.victim(0..4, |s| s != 1), Some(2));
        assert_eq!(lru.victim(2..4, |_| true), Some(2));
        lru.forget(3);
        assert_eq!(lru.victim(0..4, |_| true), Some(3));
        assert_eq!(lru.victim(0..4, |_| false), None);
    }
}
