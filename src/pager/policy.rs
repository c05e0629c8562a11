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
    /// What the policy has learned, for a hot set: each expert's use count
    /// now (held or not). Empty for a policy that keeps none.
    fn counts(&self) -> Vec<(ExpertKey, f64)> {
        Vec::new()
    }
    /// Starts from the counts a previous run saved.
    fn learn(&mut self, _counts: &[(ExpertKey, f64)]) {}
}

/// The policies there are, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Frequency with aging, aware of the layer cycle (`Freq`).
    #[default]
    Freq,
    /// Least recently used.
    Lru,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 2] = [PolicyKind::Freq, PolicyKind::Lru];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Freq => "freq",
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
            PolicyKind::Freq => Box::new(Freq::new(n_slots)),
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

/// How many of its layer's batches it takes an expert's use count to
/// halve in `Freq`: long enough to learn which experts a model favours,
/// short enough to follow a change of subject within a few hundred tokens.
/// Chosen by replaying traces (docs/BENCHMARKS.md, "Speed II").
pub const FREQ_HALF_LIFE: f64 = 64.0;

/// Frequency with aging, aware of the layer cycle: every expert (held or
/// not) keeps a use count that halves every `FREQ_HALF_LIFE` batches of its
/// layer, which estimates p, the chance its layer's next batch uses it. The
/// victim is the held expert whose next use is expected farthest away:
/// 1/p − 1 tokens, plus the fraction of a token until its layer runs again,
/// so among equals the layer that just ran (needed last) gives a slot up.
///
/// This is where LRU fails: layers run in a fixed cycle, so once the arena
/// holds less than a token's experts for every layer, the least recently
/// used expert belongs to the layer that runs next. A count survives
/// eviction, so an expert the router favours comes back with its history.
pub struct Freq {
    /// Per slot: the expert held, and whether it was filled (prefetched,
    /// preloaded) and not used since, which counts as one use.
    slots: Vec<Option<(ExpertKey, bool)>>,
    /// Per layer, per expert: (count, the layer's batch it was updated at).
    counts: Vec<Vec<(f64, u64)>>,
    /// Per layer: batches run, and the global batch it last ran at.
    layer_batches: Vec<u64>,
    last_run: Vec<u64>,
    /// Batches run, all layers.
    now: u64,
}

impl Freq {
    pub fn new(n_slots: usize) -> Freq {
        Freq { slots: vec![None; n_slots], counts: Vec::new(), layer_batches: Vec::new(), last_run: Vec::new(), now: 0 }
    }

    fn batches_of(&self, layer: u32) -> u64 {
        self.layer_batches.get(layer as usize).copied().unwrap_or(0)
    }

    /// `key`'s count now, after aging.
    fn count(&self, key: ExpertKey) -> f64 {
        let (c, at) = self.counts.get(key.0 as usize).and_then(|l| l.get(key.1 as usize)).copied().unwrap_or((0.0, 0));
        c * decay(self.batches_of(key.0).saturating_sub(at))
    }

    /// Tokens until `slot`'s expert is expected to be used; infinite for an empty slot.
    fn next_use(&self, slot: SlotId, n_layers: f64) -> f64 {
        let Some((key, fresh)) = self.slots[slot] else { return f64::INFINITY };
        let mut count = self.count(key);
        if fresh {
            count = count.max(1.0);
        }
        // A count of c over a half-life of H batches is a rate of c·ln2/H per batch.
        let p = (count * std::f64::consts::LN_2 / FREQ_HALF_LIFE).clamp(1e-9, 1.0);
        let since = self.now - self.last_run.get(key.0 as usize).copied().unwrap_or(0);
        1.0 / p - 1.0 + (1.0 - since as f64 / n_layers).max(0.0)
    }
}

/// The factor a count keeps after `batches` of its layer.
fn decay(batches: u64) -> f64 {
    (-(batches as f64) / FREQ_HALF_LIFE).exp2()
}

impl Policy for Freq {
    fn name(&self) -> &'static str {
        "freq"
    }

    fn begin_batch(&mut self, layer: u32) {
        let l = layer as usize;
        if self.layer_batches.len() <= l {
            self.layer_batches.resize(l + 1, 0);
            self.last_run.resize(l + 1, 0);
        }
        self.now += 1;
        self.layer_batches[l] += 1;
        self.last_run[l] = self.now;
    }

    fn filled(&mut self, slot: SlotId, key: ExpertKey) {
        self.slots[slot] = Some((key, true));
    }

    fn used(&mut self, slot: SlotId, key: ExpertKey) {
        let now = self.batches_of(key.0);
        let (l, e) = (key.0 as usize, key.1 as usize);
        if self.counts.len() <= l {
            self.counts.resize(l + 1, Vec::new());
        }
        if self.counts[l].len() <= e {
            self.counts[l].resize(e + 1, (0.0, 0));
        }
        let c = &mut self.counts[l][e];
        // One count per batch, however many of the batch's tokens chose it.
        if c.1 != now || c.0 == 0.0 {
            *c = (c.0 * decay(now.saturating_sub(c.1)) + 1.0, now);
        }
        self.slots[slot] = Some((key, false));
    }

    fn forget(&mut self, slot: SlotId) {
        self.slots[slot] = None;
    }

    fn counts(&self) -> Vec<(ExpertKey, f64)> {
        let mut out = Vec::new();
        for (l, experts) in self.counts.iter().enumerate() {
            for e in 0..experts.len() {
                let key = (l as u32, e as u32);
                let c = self.count(key);
                if c > 0.0 {
                    out.push((key, c));
                }
            }
        }
        out
    }

    fn learn(&mut self, counts: &[(ExpertKey, f64)]) {
        for &((l, e), c) in counts {
            let (l, e) = (l as usize, e as usize);
            if self.counts.len() <= l {
                self.counts.resize(l + 1, Vec::new());
            }
            if self.counts[l].len() <= e {
                self.counts[l].resize(e + 1, (0.0, 0));
            }
            self.counts[l][e] = (c, self.layer_batches.get(l).copied().unwrap_or(0));
        }
    }

    fn victim(&self, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        let n_layers = self.last_run.iter().filter(|&&t| t > 0).count().max(1) as f64;
        // Farthest expected use; the lowest slot id among equals.
        slots.filter(|&s| evictable(s)).map(|s| (self.next_use(s, n_layers), s)).max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1))).map(|(_, s)| s)
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
    fn freq_keeps_what_the_router_favours_across_the_layer_cycle() {
        let mut f = Freq::new(3);
        // Layer 0 uses expert 1 every token and 2, 3, 4… once each; layer 1 runs in between.
        for t in 0..20u32 {
            f.begin_batch(0);
            f.filled(0, (0, 1));
            f.used(0, (0, 1));
            f.filled(1, (0, 10 + t));
            f.used(1, (0, 10 + t));
            f.begin_batch(1);
            f.filled(2, (1, 0));
            f.used(2, (1, 0));
        }
        // The one-off goes before the favourite, though both were just used.
        assert_eq!(f.victim(0..2, &|_| true), Some(1));
        // Equal counts: layer 1 ran last, so its expert is needed last.
        let mut g = Freq::new(2);
        g.begin_batch(0);
        g.used(0, (0, 5));
        g.begin_batch(1);
        g.used(1, (1, 5));
        assert_eq!(g.victim(0..2, &|_| true), Some(1));
        // A prefetched expert counts as used once; an empty slot goes first.
        g.filled(0, (0, 6));
        g.forget(1);
        assert_eq!(g.victim(0..2, &|_| true), Some(1));
        assert_eq!(g.victim(0..2, &|s| s == 0), Some(0));
        // Counts carry over to a fresh policy (a warm start).
        let mut h = Freq::new(2);
        h.learn(&f.counts());
        assert_eq!(h.counts(), f.counts());
        h.filled(0, (0, 1));
        h.filled(1, (0, 29));
        assert_eq!(h.victim(0..2, &|_| true), Some(1), "the favourite's history came along");
    }

    #[test]
    fn names_parse_and_unknown_ones_are_listed() {
        assert_eq!(PolicyKind::parse("LRU"), Ok(PolicyKind::Lru));
        assert_eq!(PolicyKind::parse("freq"), Ok(PolicyKind::Freq));
        assert_eq!(PolicyKind::default(), PolicyKind::Freq);
        let e = PolicyKind::parse("fifo").unwrap_err();
        assert!(e.contains("'fifo'") && e.contains("lru"), "{e}");
    }
}
