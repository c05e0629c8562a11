//! The default policy: freq with shares, freq without, LRU, or reuse, each
//! replayed in a shadow slot table, the arena following whichever has
//! been hitting more.

use super::arena::SlotId;
use super::policy::{Freq, Lru, Plan, Policy};
use super::residency::Residency;
use super::ExpertKey;
use std::ops::Range;

/// How many tokens it takes a shadow's hit count to halve in `FreqAuto`.
/// Chosen on the first half of the trained trace (steps 0-64): with the
/// reuse way among the ways, 64 left the default 0.10 points below LRU
/// there and 32 0.03, which `AUTO_MARGIN` closes (docs/BENCHMARKS.md,
/// "A chance of reuse learned as the run goes").
const AUTO_HALF_LIFE_TOKENS: f64 = 32.0;

/// How far a way's aged hits must pass the followed way's for the arena to
/// follow it instead: 0.2 %. Chosen on the same half, where switching on
/// any lead left the default 4 hits (0.03 points) below LRU at 8 token
/// cycles, where the ways are within 20 hits of each other.
const AUTO_MARGIN: f64 = 0.002;

/// Freq with shares, freq without, LRU or reuse: whichever has been
/// hitting more. None wins everywhere: on a trained model's routing,
/// shares keep more from 1.5 token cycles on, and reuse (the chance of
/// reuse learned from the run) at one token cycle and on routing from a
/// trained dense model; where the router's favourites are stable, as in
/// generated models, freq over the whole class does (docs/BENCHMARKS.md,
/// "Each layer its share"); and where the experts in use change faster
/// than the counts age, LRU leads. So four shadow slot tables, one per
/// way, replay every batch's lookups (demand only, over the plan's full
/// classes), each with its hits aged by `AUTO_HALF_LIFE_TOKENS`; the
/// arena's own victims follow the one ahead by `AUTO_MARGIN`, freq
/// without shares until another is.
pub struct FreqAuto {
    live: Freq,
    /// LRU's order over the arena's own slots, for when it leads.
    live_lru: Lru,
    /// Reuse over the arena's own slots, for when it leads.
    live_reuse: Freq,
    /// Shadows, in `Way` order.
    shadows: [Shadow; 4],
    /// The way the arena follows now.
    way: Way,
    plan: Plan,
    /// The batch under way: its layer and the experts used so far.
    batch: Option<(u32, Vec<u32>)>,
    /// The factor a shadow's hits keep per batch.
    aging: f64,
    /// The layer of the batch before the one under way.
    previous_layer: Option<u32>,
}

/// The ways `FreqAuto` follows, as indices of its shadows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    Shares = 0,
    Whole = 1,
    Lru = 2,
    Reuse = 3,
}

struct Shadow {
    res: Residency,
    hits: f64,
}

impl FreqAuto {
    pub fn new(plan: &Plan) -> FreqAuto {
        let n_slots = plan.classes.iter().map(|c| c.end).max().unwrap_or(0);
        let mut live = Freq::with_shares(n_slots, plan);
        live.shares_on = false;
        let shadow = |p: Box<dyn Policy>| Shadow { res: Residency::new(n_slots, p), hits: 0.0 };
        let n_layers = plan.layer_class.len().max(1) as f64;
        FreqAuto {
            live,
            live_lru: Lru::new(n_slots),
            live_reuse: Freq::with_reuse(n_slots, plan),
            shadows: [
                shadow(Box::new(Freq::with_shares(n_slots, plan))),
                shadow(Box::new(Freq::new(n_slots))),
                shadow(Box::new(Lru::new(n_slots))),
                shadow(Box::new(Freq::with_reuse(n_slots, plan))),
            ],
            way: Way::Whole,
            plan: plan.clone(),
            batch: None,
            aging: (-1.0 / (AUTO_HALF_LIFE_TOKENS * n_layers)).exp2(),
            previous_layer: None,
        }
    }

    /// The shadows replay the batch just done, and the one ahead leads
    /// (on a tie, the way followed now).
    fn close_batch(&mut self) {
        let Some((layer, experts)) = self.batch.take() else { return };
        let Some(class) = self.plan.layer_class.iter().find(|&&(l, _)| l == layer).and_then(|&(_, c)| self.plan.classes.get(c)).cloned() else {
            return;
        };
        // A batch right after one of its own layer is a prompt group's
        // later ubatch (patch 0013: a layer's ubatches run back to back),
        // and any way keeps what the ubatch before it read. Scored, such
        // batches are what the arena followed, and they favour LRU, which
        // a group leaves ordered by layer: the decode after the prompt
        // would follow it and read more. The shadows still replay them.
        let scored = self.previous_layer != Some(layer) || self.plan.layer_class.len() < 2;
        self.previous_layer = Some(layer);
        for sh in &mut self.shadows {
            let adm = sh.res.admit_unpinned(layer, class.clone(), &experts);
            if scored {
                sh.hits = sh.hits * self.aging + adm.hits.len() as f64;
            }
        }
        if !scored {
            return;
        }
        for way in [Way::Shares, Way::Whole, Way::Lru, Way::Reuse] {
            if self.shadows[way as usize].hits > self.shadows[self.way as usize].hits * (1.0 + AUTO_MARGIN) {
                self.way = way;
            }
        }
        self.live.shares_on = self.way == Way::Shares;
    }
}

impl Policy for FreqAuto {
    fn name(&self) -> &'static str {
        "freq-auto"
    }

    fn begin_batch(&mut self, layer: u32) {
        self.close_batch();
        self.batch = Some((layer, Vec::new()));
        self.live.begin_batch(layer);
        self.live_lru.begin_batch(layer);
        self.live_reuse.begin_batch(layer);
    }

    fn filled(&mut self, slot: SlotId, key: ExpertKey) {
        self.live.filled(slot, key);
        self.live_lru.filled(slot, key);
        self.live_reuse.filled(slot, key);
    }

    fn used(&mut self, slot: SlotId, key: ExpertKey) {
        if let Some((layer, experts)) = &mut self.batch {
            if *layer == key.layer && !experts.contains(&key.expert) {
                experts.push(key.expert);
            }
        }
        self.live.used(slot, key);
        self.live_lru.used(slot, key);
        self.live_reuse.used(slot, key);
    }

    fn forget(&mut self, slot: SlotId) {
        self.live.forget(slot);
        self.live_lru.forget(slot);
        self.live_reuse.forget(slot);
    }

    fn victim(&self, layer: u32, slots: Range<SlotId>, evictable: &dyn Fn(SlotId) -> bool) -> Option<SlotId> {
        match self.way {
            Way::Lru => self.live_lru.victim(layer, slots, evictable),
            Way::Reuse => self.live_reuse.victim(layer, slots, evictable),
            Way::Shares | Way::Whole => self.live.victim(layer, slots, evictable),
        }
    }

    fn counts(&self) -> Vec<(ExpertKey, f64)> {
        self.live.counts()
    }

    fn learn(&mut self, counts: &[(ExpertKey, f64)]) {
        self.live.learn(counts);
        self.live_reuse.learn(counts);
        for sh in &mut self.shadows {
            sh.res.learn(counts);
        }
    }
}
