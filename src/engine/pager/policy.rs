//! Which slot to evict. A policy is pure bookkeeping, no I/O, so the pager
//! and `sdq replay` run the same code.
//!
//! Policies see time in batches: `begin_batch(layer)` starts one layer of
//! one step, and every use within it happens at the same instant. What they
//! decide then depends only on the routing, not on which of ggml's threads
//! got to an expert first, so a recorded trace replays to the live run's
//! decisions.
//!
//! This file holds the trait and the two policies it is written for:
//! [`Lru`], the baseline every figure is set against, and [`Freq`], decayed
//! use counts with a share of the slots per layer and the chance of reuse
//! (`reuse`), which `freq-auto` (`freq_auto`) runs with its shares on or
//! off. They stay together because they keep time the same way (batches of
//! a layer) and the tests at the bottom set one against the other; `sdq
//! replay`'s optimum, which sees the future, lives with the replay instead.

use super::arena::SlotId;
use super::reuse::Reuse;
use super::{expert_cell, ExpertKey};
use std::cell::RefCell;
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
    /// The slot in `slots` to give an expert of `layer` (a miss or a
    /// prefetch), among those for which `evictable` holds. None only when
    /// no slot is evictable.
    fn victim(&self, layer: u32, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId>;
    /// What the policy has learned, for a hot set: each expert's use count
    /// now (held or not). Empty for a policy that keeps none.
    fn counts(&self) -> Vec<(ExpertKey, f64)> {
        Vec::new()
    }
    /// Starts from the counts a previous run saved.
    fn learn(&mut self, _counts: &[(ExpertKey, f64)]) {}
}

/// What a policy is told of the arena: each layer's slot class, and each
/// class's slots.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// (layer, index into `classes`), one per paged layer.
    pub layer_class: Vec<(u32, usize)>,
    pub classes: Vec<Range<SlotId>>,
    /// Experts a token takes in each layer (0: not known).
    pub top_k: usize,
}

impl Plan {
    /// The plan of `layout`'s layers over `classes`, for a model whose
    /// tokens take `top_k` experts a layer.
    pub fn new(layout: &super::layout::Layout, classes: &[super::arena::SlotClass], top_k: usize) -> Plan {
        Plan { layer_class: layout.layers.values().map(|l| (l.layer, l.class)).collect(), classes: classes.iter().map(|c| c.slots()).collect(), top_k }
    }

    /// Per layer: how many layers share its slot class (0 for a layer not
    /// in the plan).
    fn class_layers(&self) -> Vec<usize> {
        let n_layers = self.layer_class.iter().map(|&(l, _)| l as usize + 1).max().unwrap_or(0);
        let mut sharers = vec![0; n_layers];
        for &(l, c) in &self.layer_class {
            sharers[l as usize] = self.layer_class.iter().filter(|&&(_, c2)| c2 == c).count();
        }
        sharers
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

    fn victim(&self, _layer: u32, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
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
///
/// With shares (`Freq::with_shares`; the default, `FreqAuto`, turns them
/// on while they hit more) each layer owns an equal share of its slot
/// class: a layer holding its share gives up its own expert of the
/// farthest expected use, or an expert of any layer whose count has aged
/// below one use, and a layer under its share takes from the layers over
/// theirs. The counts of different layers compare badly on a trained
/// model's routing: held to equal shares, the same counts keep 2–3 points
/// more from 1.5 to 4 token cycles than ranked across the whole class
/// (docs/BENCHMARKS.md, "Each layer its share").
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
    /// Per layer, from the plan: how many layers share its slot class (0
    /// for a layer not in the plan, which has no share). Empty without a
    /// plan (`Freq::new`).
    class_layers: Vec<usize>,
    /// Whether it keeps each layer to its share (`Freq::with_shares`).
    has_shares: bool,
    /// With shares: per layer, the range of its class's slots (empty for a
    /// layer not in the plan).
    class_slots: Vec<Range<SlotId>>,
    /// With shares: per layer, how many slots hold its experts, kept as
    /// slots change so that shares need not count them at every miss.
    held: Vec<usize>,
    /// Whether the shares apply now (`FreqAuto` switches them).
    pub(super) shares_on: bool,
    /// With it, a slot's worth is its expert's chance of use within the
    /// tokens the arena holds, not its expected next use (`Freq::with_reuse`).
    reuse: Option<Box<Reuse>>,
    /// Each slot's score (`next_use`, or with reuse its worth negated)
    /// within the batch under way, for the horizon it was found at (NaN:
    /// not found yet). Within a batch only the batch's own experts, which
    /// are not evicted, and the slots filled or used change score, so a
    /// batch's misses score the class once.
    score_cache: RefCell<(f64, Vec<f64>)>,
}

/// Below this count (one use, aged) an expert is up for eviction by any
/// layer of its class, not only its own: it is what lets a layer with
/// fewer experts worth keeping than its share lend the rest.
const LENDABLE_COUNT: f64 = 1.0;

impl Freq {
    pub fn new(n_slots: usize) -> Freq {
        Freq {
            slots: vec![None; n_slots],
            counts: Vec::new(),
            layer_batches: Vec::new(),
            last_run: Vec::new(),
            now: 0,
            class_layers: Vec::new(),
            has_shares: false,
            class_slots: Vec::new(),
            held: Vec::new(),
            shares_on: false,
            reuse: None,
            score_cache: RefCell::new((f64::NAN, Vec::new())),
        }
    }

    /// Freq with each layer in an equal share of its class, as `plan` gives
    /// each layer's class.
    pub fn with_shares(n_slots: usize, plan: &Plan) -> Freq {
        let class_layers = plan.class_layers();
        let mut class_slots = vec![0..0; class_layers.len()];
        for &(l, c) in &plan.layer_class {
            class_slots[l as usize] = plan.classes.get(c).cloned().unwrap_or(0..0);
        }
        Freq { class_layers, has_shares: true, class_slots, shares_on: true, ..Freq::new(n_slots) }
    }

    /// Freq over the whole class that keeps the experts likeliest to be
    /// used within the tokens the arena holds, by a chance of reuse learned
    /// from the run's routing (`ReuseTable`), where plain freq keeps those
    /// whose next use is expected soonest from the count alone. Named
    /// `reuse`; the default follows it while it hits more.
    ///
    /// The horizon matters because use comes in bursts: an expert just used
    /// is likely back within a token or two and unlikely after that, so in
    /// an arena of one or two tokens it is worth more than one of a higher
    /// count, and in a larger one less.
    pub fn with_reuse(n_slots: usize, plan: &Plan) -> Freq {
        Freq { class_layers: plan.class_layers(), reuse: Some(Box::new(Reuse::new(FREQ_HALF_LIFE, plan.top_k))), ..Freq::new(n_slots) }
    }

    /// The evictable slot in `slots` (of `layer`'s class) allowed by
    /// `allowed` whose expert's next use is expected farthest away (with
    /// reuse: least likely within the horizon); an empty one first, the
    /// lowest slot id among equals.
    fn farthest(&self, layer: u32, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool, allowed: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        let n_layers = self.last_run.iter().filter(|&&t| t > 0).count().max(1) as f64;
        // `slots` are the slots of `layer`'s class usable now.
        let horizon = self.reuse.as_deref().map_or(0.0, |r| r.horizon(slots.len(), self.class_layers.get(layer as usize).copied().unwrap_or(1)));
        let mut cache = self.score_cache.borrow_mut();
        if cache.0 != horizon {
            // A new batch or horizon: every score is to be found again, in
            // the same vector (one allocation for the run, not one a batch).
            cache.0 = horizon;
            cache.1.clear();
            cache.1.resize(self.slots.len(), f64::NAN);
        }
        let mut score = |s: SlotId| {
            if cache.1[s].is_nan() {
                cache.1[s] = match self.reuse.as_deref() {
                    Some(r) => -self.worth(r, s, n_layers, horizon),
                    None => self.next_use(s, n_layers),
                };
            }
            cache.1[s]
        };
        slots.filter(|&s| evictable(s) && allowed(s)).map(|s| (score(s), s)).max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1))).map(|(_, s)| s)
    }

    fn batches_of(&self, layer: u32) -> u64 {
        self.layer_batches.get(layer as usize).copied().unwrap_or(0)
    }

    /// `key`'s count now, after aging.
    fn count(&self, key: ExpertKey) -> f64 {
        let (c, at) = self.counts.get(key.layer as usize).and_then(|l| l.get(key.expert as usize)).copied().unwrap_or((0.0, 0));
        c * decay(self.batches_of(key.layer).saturating_sub(at))
    }

    /// `slot`'s expert, its count, and whether it was filled and not used
    /// since (prefetched, preloaded), which counts as one use: None for an
    /// empty slot.
    fn held_expert(&self, slot: SlotId) -> Option<(ExpertKey, f64, bool)> {
        let (key, fresh) = self.slots[slot]?;
        let count = self.count(key);
        Some((key, if fresh { count.max(1.0) } else { count }, fresh))
    }

    /// Tokens until `slot`'s expert is expected to be used; infinite for an empty slot.
    fn next_use(&self, slot: SlotId, n_layers: f64) -> f64 {
        let Some((key, count, _)) = self.held_expert(slot) else { return f64::INFINITY };
        // A count of c over a half-life of H batches is a rate of c·ln2/H per batch.
        let p = (count * std::f64::consts::LN_2 / FREQ_HALF_LIFE).clamp(1e-9, 1.0);
        1.0 / p - 1.0 + self.until_run(key.layer, n_layers)
    }

    /// `slot` now holds `to`: its score is to be found again, and with
    /// shares the layers' held counts follow.
    fn set_slot(&mut self, slot: SlotId, to: Option<(ExpertKey, bool)>) {
        self.forget_score(slot);
        if !self.has_shares {
            self.slots[slot] = to;
            return;
        }
        if let Some((ExpertKey { layer: l, .. }, _)) = self.slots[slot] {
            self.held[l as usize] -= 1;
        }
        if let Some((ExpertKey { layer: l, .. }, _)) = to {
            if self.held.len() <= l as usize {
                self.held.resize(l as usize + 1, 0);
            }
            self.held[l as usize] += 1;
        }
        self.slots[slot] = to;
    }

    /// Per layer: how many of `slots` hold its experts (at least `layer + 1` long).
    fn held_in(&self, layer: u32, slots: &Range<SlotId>) -> std::borrow::Cow<'_, [usize]> {
        let n = self.held.len().max(layer as usize + 1);
        if self.class_slots.get(layer as usize) == Some(slots) && self.held.len() == n {
            // The whole class: a layer's experts are held in its class only.
            return std::borrow::Cow::Borrowed(&self.held);
        }
        let mut held = vec![0usize; n];
        for s in slots.clone() {
            if let Some((ExpertKey { layer: l, .. }, _)) = self.slots[s] {
                held[l as usize] += 1;
            }
        }
        std::borrow::Cow::Owned(held)
    }

    /// `slot`'s score is to be found again.
    fn forget_score(&mut self, slot: SlotId) {
        if let Some(w) = self.score_cache.get_mut().1.get_mut(slot) {
            *w = f64::NAN;
        }
    }

    /// The part of a token until `layer` runs again (1 for the layer
    /// running now).
    fn until_run(&self, layer: u32, n_layers: f64) -> f64 {
        let since = self.now - self.last_run.get(layer as usize).copied().unwrap_or(0);
        (1.0 - since as f64 / n_layers).max(0.0)
    }

    /// With reuse: what keeping `slot`'s expert is worth, in expected uses
    /// per token of the slot's time: over its layer's runs within `horizon`
    /// tokens, the chance its first use is at each, over the tokens until
    /// then plus one. An empty slot is worth nothing and goes first.
    ///
    /// Dividing by the wait is what makes the cycle of layers count: of two
    /// experts as likely to be used, the one whose layer runs sooner frees
    /// its slot sooner, and the layer that just ran waits longest.
    fn worth(&self, r: &Reuse, slot: SlotId, n_layers: f64, horizon: f64) -> f64 {
        let Some((key, count, fresh)) = self.held_expert(slot) else { return -1.0 };
        let since = match r.last_use(key) {
            // Filled and not used since (prefetched, preloaded): as if just used.
            _ if fresh => 1,
            0 => u64::MAX / 2,
            last => (self.batches_of(key.layer) + 1).saturating_sub(last),
        };
        let until = self.until_run(key.layer, n_layers);
        // A use further ahead than this is worth under a seventeenth of one now.
        let runs = ((horizon - until).floor().max(0.0) as u64 + 1).min(MAX_REUSE_RUNS);
        let chance = r.table.chances(count);
        let (mut unused, mut worth) = (1.0, 0.0);
        for k in 0..runs {
            let p = chance(since.saturating_add(k));
            worth += unused * p / (until + k as f64 + 1.0);
            unused *= 1.0 - p;
        }
        worth
    }
}

/// The most runs of its layer `Freq::worth` looks ahead.
const MAX_REUSE_RUNS: u64 = 16;

/// The factor a count keeps after `batches` of its layer.
fn decay(batches: u64) -> f64 {
    match DECAY.get(batches as usize) {
        Some(&d) => d,
        None => decay_of(batches),
    }
}

fn decay_of(batches: u64) -> f64 {
    (-(batches as f64) / FREQ_HALF_LIFE).exp2()
}

/// `decay` of the ages a count is read at most (every slot's scan reads
/// one), found once: the same values, without an `exp2` per read.
static DECAY: once_cell::sync::Lazy<Vec<f64>> = once_cell::sync::Lazy::new(|| (0..DECAY_TABLE).map(decay_of).collect());
const DECAY_TABLE: u64 = 4096;

impl Policy for Freq {
    fn name(&self) -> &'static str {
        match (self.has_shares, self.reuse.is_some()) {
            (_, true) => "reuse",
            (true, false) => "freq-shares",
            (false, false) => "freq",
        }
    }

    fn begin_batch(&mut self, layer: u32) {
        self.score_cache.get_mut().0 = f64::NAN;
        if let Some(mut r) = self.reuse.take() {
            // The batch before this one is done: what its layer used is known.
            if let Some(done) = r.batch_layer() {
                r.close_batch(|e| self.count(ExpertKey::new(done, e)));
            }
            r.begin_batch(layer, self.batches_of(layer) + 1);
            self.reuse = Some(r);
        }
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
        self.set_slot(slot, Some((key, true)));
    }

    fn used(&mut self, slot: SlotId, key: ExpertKey) {
        let now = self.batches_of(key.layer);
        if self.reuse.is_some() {
            let before = self.count(key);
            if let Some(r) = self.reuse.as_deref_mut() {
                r.used(key, before);
            }
        }
        let c = expert_cell(&mut self.counts, key);
        // One count per batch, however many of the batch's tokens chose it.
        if c.1 != now || c.0 == 0.0 {
            *c = (c.0 * decay(now.saturating_sub(c.1)) + 1.0, now);
        }
        self.set_slot(slot, Some((key, false)));
    }

    fn forget(&mut self, slot: SlotId) {
        self.set_slot(slot, None);
    }

    fn counts(&self) -> Vec<(ExpertKey, f64)> {
        let mut out = Vec::new();
        for (l, experts) in self.counts.iter().enumerate() {
            for e in 0..experts.len() {
                let key = ExpertKey::new(l as u32, e as u32);
                let c = self.count(key);
                if c > 0.0 {
                    out.push((key, c));
                }
            }
        }
        out
    }

    fn learn(&mut self, counts: &[(ExpertKey, f64)]) {
        // New counts: every slot's score is to be found again.
        self.score_cache.get_mut().0 = f64::NAN;
        for &(key, c) in counts {
            *expert_cell(&mut self.counts, key) = (c, self.batches_of(key.layer));
        }
    }

    fn victim(&self, layer: u32, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        let any = |_: SlotId| true;
        let Some(sharers) = self.class_layers.get(layer as usize).copied().filter(|&n| n > 0 && self.has_shares && self.shares_on) else {
            return self.farthest(layer, slots, evictable, &any);
        };
        let share = (slots.len() / sharers).max(1);
        let held = self.held_in(layer, &slots);
        let chosen = if held[layer as usize] >= share {
            // At its share: its own, or what its layer no longer uses.
            self.farthest(layer, slots.clone(), evictable, &|s| match self.slots[s] {
                None => true,
                Some((key, fresh)) => key.layer == layer || (!fresh && self.count(key) < LENDABLE_COUNT),
            })
        } else {
            // Under its share: from a layer over its own.
            self.farthest(layer, slots.clone(), evictable, &|s| match self.slots[s] {
                None => true,
                Some((ExpertKey { layer: l, .. }, _)) => held[l as usize] > share,
            })
        };
        // Nothing so allowed is evictable (pinned, or a prefetch that may
        // not touch its own layer): the farthest of any layer.
        chosen.or_else(|| self.farthest(layer, slots, evictable, &any))
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
            lru.filled(s, ExpertKey::new(0, s as u32));
        }
        lru.begin_batch(0);
        lru.used(0, ExpertKey::new(0, 0));
        assert_eq!(lru.victim(0, 0..4, &|_| true), Some(1));
        assert_eq!(lru.victim(0, 0..4, &|s| s != 1), Some(2));
        assert_eq!(lru.victim(0, 2..4, &|_| true), Some(2));
        lru.forget(3);
        assert_eq!(lru.victim(0, 0..4, &|_| true), Some(3));
        assert_eq!(lru.victim(0, 0..4, &|_| false), None);
        // Uses within one batch are one instant: the lowest slot goes first.
        lru.begin_batch(1);
        for s in [3, 2, 1] {
            lru.used(s, ExpertKey::new(1, s as u32));
        }
        assert_eq!(lru.victim(0, 1..4, &|_| true), Some(1));
    }

    #[test]
    fn freq_keeps_what_the_router_favours_across_the_layer_cycle() {
        let mut f = Freq::new(3);
        // Layer 0 uses expert 1 every token and 2, 3, 4… once each; layer 1 runs in between.
        for t in 0..20u32 {
            f.begin_batch(0);
            f.filled(0, ExpertKey::new(0, 1));
            f.used(0, ExpertKey::new(0, 1));
            f.filled(1, ExpertKey::new(0, 10 + t));
            f.used(1, ExpertKey::new(0, 10 + t));
            f.begin_batch(1);
            f.filled(2, ExpertKey::new(1, 0));
            f.used(2, ExpertKey::new(1, 0));
        }
        // The one-off goes before the favourite, though both were just used.
        assert_eq!(f.victim(0, 0..2, &|_| true), Some(1));
        // Equal counts: layer 1 ran last, so its expert is needed last.
        let mut g = Freq::new(2);
        g.begin_batch(0);
        g.used(0, ExpertKey::new(0, 5));
        g.begin_batch(1);
        g.used(1, ExpertKey::new(1, 5));
        assert_eq!(g.victim(0, 0..2, &|_| true), Some(1));
        // A prefetched expert counts as used once; an empty slot goes first.
        g.filled(0, ExpertKey::new(0, 6));
        g.forget(1);
        assert_eq!(g.victim(0, 0..2, &|_| true), Some(1));
        assert_eq!(g.victim(0, 0..2, &|s| s == 0), Some(0));
        // Counts carry over to a fresh policy (a warm start).
        let mut h = Freq::new(2);
        h.learn(&f.counts());
        assert_eq!(h.counts(), f.counts());
        h.filled(0, ExpertKey::new(0, 1));
        h.filled(1, ExpertKey::new(0, 29));
        assert_eq!(h.victim(0, 0..2, &|_| true), Some(1), "the favourite's history came along");
    }

    #[test]
    fn with_shares_a_layer_gives_up_its_own_until_under_its_share() {
        // Two layers share one class of 4 slots: a share of 2 each.
        let plan = Plan { layer_class: vec![(0, 0), (1, 0)], classes: std::iter::once(0..4).collect(), top_k: 2 };
        let mut f = Freq::with_shares(4, &plan);
        let use_in = |f: &mut Freq, slot: SlotId, key: ExpertKey, times: u32| {
            for _ in 0..times {
                f.begin_batch(key.layer);
                f.filled(slot, key);
                f.used(slot, key);
            }
        };
        // Layer 0 holds two favourites, layer 1 two experts used less.
        use_in(&mut f, 0, ExpertKey::new(0, 1), 8);
        use_in(&mut f, 1, ExpertKey::new(0, 2), 6);
        use_in(&mut f, 2, ExpertKey::new(1, 1), 3);
        use_in(&mut f, 3, ExpertKey::new(1, 2), 2);
        // Without shares, layer 0's miss would take layer 1's least used.
        let mut whole = Freq::with_shares(4, &plan);
        whole.shares_on = false;
        for (slot, key, n) in [(0, ExpertKey::new(0, 1), 8), (1, ExpertKey::new(0, 2), 6), (2, ExpertKey::new(1, 1), 3), (3, ExpertKey::new(1, 2), 2)] {
            use_in(&mut whole, slot, key, n);
        }
        assert_eq!(whole.victim(0, 0..4, &|_| true), Some(3));
        // With them, layer 0 is at its share: it gives up its own.
        f.begin_batch(0);
        assert_eq!(f.victim(0, 0..4, &|_| true), Some(1));
        // Pinned, its own cannot go: then the farthest of any layer.
        assert_eq!(f.victim(0, 0..4, &|s| s >= 2), Some(3));
        // Layer 1 holding 3 of 4 slots, layer 0 (under its share) takes
        // layer 1's least used, though its own in slot 0 is used less.
        f.forget(1);
        f.filled(1, ExpertKey::new(1, 9));
        for _ in 0..4 {
            f.begin_batch(1);
            f.used(1, ExpertKey::new(1, 9));
        }
        f.forget(0);
        f.filled(0, ExpertKey::new(0, 5));
        f.used(0, ExpertKey::new(0, 5));
        f.begin_batch(0);
        assert_eq!(f.victim(0, 0..4, &|_| true), Some(3));
        // The held counts kept as slots change are those of a scan; a part
        // of the class (an arena shrunk) is scanned.
        assert_eq!(&f.held_in(0, &(0..4))[..2], &[1, 3]);
        assert_eq!(&f.held_in(1, &(0..3))[..2], &[1, 2]);
        f.forget(0);
        assert_eq!(&f.held_in(0, &(0..4))[..2], &[0, 3]);
        // An expert used once long ago is lent to any layer.
        let mut g = Freq::with_shares(4, &plan);
        use_in(&mut g, 0, ExpertKey::new(0, 1), 8);
        use_in(&mut g, 1, ExpertKey::new(0, 2), 6);
        use_in(&mut g, 2, ExpertKey::new(1, 1), 1);
        use_in(&mut g, 3, ExpertKey::new(1, 2), 6);
        for _ in 0..10 {
            g.begin_batch(1);
            g.used(3, ExpertKey::new(1, 2));
        }
        g.begin_batch(0);
        assert!(g.count(ExpertKey::new(1, 1)) < LENDABLE_COUNT);
        assert_eq!(g.victim(0, 0..4, &|_| true), Some(2));
    }
}
