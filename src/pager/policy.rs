//! Which slot to evict. A policy is pure bookkeeping, no I/O, so the pager
//! and `sdq replay` run the same code.
//!
//! Policies see time in batches: `begin_batch(layer)` starts one layer of
//! one step, and every use within it happens at the same instant. What they
//! decide then depends only on the routing, not on which of ggml's threads
//! got to an expert first, so a recorded trace replays to the live run's
//! decisions.

use super::arena::SlotId;
use super::ExpertKey;
use std::ops::Range;

/// An eviction policy over the arena's slots.
pub trait Policy: Send {
    /// The policy's name, as `--sdq-policy` takes it.
    fn name(&self) -> &'static str;
    /// A batch of `layer` starts: the uses until the next call are one instant.
    fn begin_batch(&mut self, layer: u32);
    /// `slot` now holds `key` (read on demand, prefetched or preloaded).
    fn filled(&mut self, slot: SlotId, key: ExpertKey);
    /// The current batch uses `key`, in `slot`.
    fn used(&mut self, slot: SlotId, key: ExpertKey);
    /// `slot` holds nothing worth keeping (a failed read).
    fn forget(&mut self, slot: SlotId);
    /// The slot in `slots` to evict among those for which `evictable` holds.
    fn victim(&self, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId>;
}

/// The policies there are, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used.
    #[default]
    Lru,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 1] = [PolicyKind::Lru];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
        }
    }

    /// The policy called `name`, or an error listing the names there are.
    pub fn parse(name: &str) -> Result<PolicyKind, String> {
        let name = name.trim();
        PolicyKind::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(name)).ok_or_else(|| {
            format!("unknown policy '{name}' (one of: {})", PolicyKind::ALL.map(|k| k.name()).join(", "))
        })
    }

    /// A fresh policy of this kind over `n_slots` slots.
    pub fn build(self, n_slots: usize) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(n_slots)),
        }
    }
}

/// Least-recently-used order over slots, in batches: a slot's time is the
/// last batch that filled or used it. A slot never used (or forgotten) has
/// time 0 and goes first; ties go to the lowest slot id.
#[derive(Clone, Debug)]
pub struct Lru {
    last_use: Vec<u64>,
    clock: u64,
}

impl Lru {
    pub fn new(n_slots: usize) -> Lru {
        Lru { last_use: vec![0; n_slots], clock: 0 }
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn begin_batch(&mut self, _layer: u32) {
        self.clock += 1;
    }

    fn filled(&mut self, slot: SlotId, _key: ExpertKey) {
        self.last_use[slot] = self.clock.max(1);
    }

    fn used(&mut self, slot: SlotId, _key: ExpertKey) {
        self.last_use[slot] = self.clock.max(1);
    }

    fn forget(&mut self, slot: SlotId) {
        self.last_use[slot] = 0;
    }

    fn victim(&self, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        slots.filter(|&s| evictable(s)).min_by_key(|&s| self.last_use[s])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recent_batch_unpinned() {
        let mut lru = Lru::new(4);
        for s in [0, 1, 2, 3] {
            lru.begin_batch(0);
            lru.filled(s, (0, s as u32));
        }
        lru.begin_batch(0);
        lru.used(0, (0, 0));
        assert_eq!(lru.victim(0..4, &|_| true), Some(1));
        assert_eq!(lru.victim(0..4, &|s| s != 1), Some(2));
        assert_eq!(lru.victim(2..4, &|_| true), Some(2));
        lru.forget(3);
        assert_eq!(lru.victim(0..4, &|_| true), Some(3));
        assert_eq!(lru.victim(0..4, &|_| false), None);
        // Uses within one batch are one instant: the lowest slot goes first.
        lru.begin_batch(1);
        for s in [3, 2, 1] {
            lru.used(s, (1, s as u32));
        }
        assert_eq!(lru.victim(1..4, &|_| true), Some(1));
    }

    #[test]
    fn names_parse_and_unknown_ones_are_listed() {
        assert_eq!(PolicyKind::parse("LRU"), Ok(PolicyKind::Lru));
        let e = PolicyKind::parse("fifo").unwrap_err();
        assert!(e.contains("'fifo'") && e.contains("lru"), "{e}");
    }
}
