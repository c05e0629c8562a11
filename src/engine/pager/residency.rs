//! Which expert each arena slot holds, and how a batch's lookups are
//! counted and given slots: the accounting the pager and `sdq replay` share.
//! It knows nothing of reads or pins; callers say which slots may be evicted.

use super::arena::SlotId;
use super::policy::Policy;
use super::{expert_cell, ExpertKey};
use std::ops::Range;

/// The slot table and the eviction policy that fills it.
pub struct Residency {
    keys: Vec<Option<ExpertKey>>,
    /// Per layer, per expert: its slot. Dense, as layers and experts are
    /// numbered from 0: a lookup per use, where hashing the key cost as
    /// much as the policy's bookkeeping.
    table: Vec<Vec<Option<SlotId>>>,
    /// Experts held.
    held: usize,
    policy: Box<dyn Policy>,
}

/// A miss given a slot: `slot` now holds `expert`; it held `evicted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    pub expert: u32,
    pub slot: SlotId,
    pub evicted: Option<ExpertKey>,
}

/// What one batch's lookups found (see `Residency::admit`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Experts in a slot already (or being read into one): (expert, slot).
    pub hits: Vec<(u32, SlotId)>,
    /// Misses given a slot.
    pub fills: Vec<Fill>,
    /// Misses left without a slot: every evictable slot of the class holds
    /// an expert of this batch. They get one once the batch is done with
    /// others (`Residency::victim`, then `fill`).
    pub deferred: Vec<u32>,
}

impl Residency {
    pub fn new(n_slots: usize, policy: Box<dyn Policy>) -> Residency {
        Residency { keys: vec![None; n_slots], table: Vec::new(), held: 0, policy }
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The slot holding (or being filled with) `key`.
    pub fn slot_of(&self, key: ExpertKey) -> Option<SlotId> {
        self.table.get(key.layer as usize).and_then(|l| l.get(key.expert as usize)).copied().flatten()
    }

    /// What `slot` holds (or is being filled with).
    pub fn key(&self, slot: SlotId) -> Option<ExpertKey> {
        self.keys[slot]
    }

    /// Experts held.
    pub fn len(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// One batch's lookups of `experts` (distinct) of `layer`, whose slots
    /// are `class`: each is a hit if held, else a miss that takes the
    /// policy's victim among the evictable slots that hold none of the
    /// batch's experts. The policy sees the batch begin and each expert used.
    pub fn admit(&mut self, layer: u32, class: Range<SlotId>, experts: &[u32], evictable: &dyn Fn(SlotId) -> bool) -> Admission {
        self.policy.begin_batch(layer);
        let mut out = Admission::default();
        let mut batch = vec![false; experts.iter().max().map_or(0, |&e| e as usize + 1)];
        for &e in experts {
            batch[e as usize] = true;
        }
        let in_batch = |keys: &[Option<ExpertKey>], s: SlotId| matches!(keys[s], Some(k) if k.layer == layer && batch.get(k.expert as usize) == Some(&true));
        for &e in experts {
            let key = ExpertKey::new(layer, e);
            if let Some(slot) = self.slot_of(key) {
                self.policy.used(slot, key);
                out.hits.push((e, slot));
                continue;
            }
            let keys = &self.keys;
            match self.policy.victim(layer, class.clone(), &|s| evictable(s) && !in_batch(keys, s)) {
                Some(slot) => {
                    let evicted = self.fill(slot, key);
                    self.policy.used(slot, key);
                    out.fills.push(Fill { expert: e, slot, evicted });
                }
                None => out.deferred.push(e),
            }
        }
        out
    }

    /// One batch as a pager with one compute thread and nothing pinned runs
    /// it: `admit` with every slot evictable, then each deferred miss takes
    /// the policy's victim once the batch is done with the others. What
    /// `sdq replay` and the policies' shadow tables count.
    pub fn admit_unpinned(&mut self, layer: u32, class: Range<SlotId>, experts: &[u32]) -> Admission {
        let adm = self.admit(layer, class.clone(), experts, &|_| true);
        for &e in &adm.deferred {
            let slot = self.victim(layer, class.clone(), &|_| true).expect("a class has slots");
            self.fill(slot, ExpertKey::new(layer, e));
            self.used(slot);
        }
        adm
    }

    /// The policy's victim in `class`, for an expert of `layer`, among the
    /// slots for which `evictable` holds.
    pub fn victim(&self, layer: u32, class: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        self.policy.victim(layer, class, evictable)
    }

    /// Gives `slot` to `key`; returns what it held.
    pub fn fill(&mut self, slot: SlotId, key: ExpertKey) -> Option<ExpertKey> {
        let old = self.keys[slot].take();
        if let Some(old) = old {
            *expert_cell(&mut self.table, old) = None;
            self.held -= 1;
        }
        if let Some(prev) = expert_cell(&mut self.table, key).replace(slot) {
            // A key lives in one slot: filling a second would leave the
            // first stale and published.
            panic!("expert {key:?} filled into slot {slot} while slot {prev} holds it");
        }
        self.held += 1;
        self.keys[slot] = Some(key);
        self.policy.filled(slot, key);
        old
    }

    /// The current batch uses what `slot` holds (a fill outside `admit`).
    pub fn used(&mut self, slot: SlotId) {
        if let Some(key) = self.keys[slot] {
            self.policy.used(slot, key);
        }
    }

    /// Empties `slot` (its read failed): it goes first.
    pub fn clear(&mut self, slot: SlotId) {
        if let Some(old) = self.keys[slot].take() {
            *expert_cell(&mut self.table, old) = None;
            self.held -= 1;
        }
        self.policy.forget(slot);
    }

    /// The policy's use counts (see `Policy::counts`).
    pub fn counts(&self) -> Vec<(ExpertKey, f64)> {
        self.policy.counts()
    }

    /// Starts the policy from saved counts.
    pub fn learn(&mut self, counts: &[(ExpertKey, f64)]) {
        self.policy.learn(counts);
    }

    /// Every (slot, expert) held.
    pub fn held(&self) -> impl Iterator<Item = (SlotId, ExpertKey)> + '_ {
        self.keys.iter().enumerate().filter_map(|(s, k)| k.map(|k| (s, k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::pager::policy::Lru;

    #[test]
    fn a_batch_never_evicts_its_own_experts() {
        let mut r = Residency::new(3, Box::new(Lru::new(3)));
        let a = r.admit(0, 0..3, &[5, 6], &|_| true);
        assert_eq!((a.hits.len(), a.fills.len(), a.deferred.len()), (0, 2, 0));
        // 6 is held; 7 and 8 need two slots but only one holds nothing of the batch.
        let a = r.admit(0, 0..3, &[6, 7, 8], &|_| true);
        assert_eq!(a.hits, vec![(6, r.slot_of(ExpertKey::new(0, 6)).unwrap())]);
        assert_eq!(a.fills.len(), 2);
        assert_eq!(a.fills[1].evicted, Some(ExpertKey::new(0, 5)));
        assert_eq!(a.deferred, Vec::<u32>::new());
        let a = r.admit(1, 0..3, &[1, 2, 3, 4], &|s| s != 0);
        assert_eq!(a.fills.len(), 2, "slot 0 is not evictable");
        assert_eq!(a.deferred, vec![3, 4]);
        assert_eq!(r.len(), 3);
        r.clear(a.fills[0].slot);
        assert_eq!(r.slot_of(ExpertKey::new(1, 1)), None);
        assert_eq!(r.victim(0, 0..3, &|_| true), Some(a.fills[0].slot));
    }
}
