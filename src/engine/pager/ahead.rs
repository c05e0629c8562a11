//! Reads ahead: experts a later layer (or a prompt group's later ubatch)
//! will need, read at low priority into slots nobody is about to use, so
//! that they arrive while the layer before computes.

use super::{Ahead, ExpertKey, Lane, Pager, SlotId, State};

impl Pager {
    /// Starts reading the experts of `layer` in `experts` (best first) that
    /// are not in the arena, at low priority, while layer `current` is being
    /// computed. A victim must be unpinned and hold no expert of `current` or
    /// `layer`; it stops at the first expert with no such slot.
    pub fn prefetch(&self, layer: u32, experts: &[u32], current: u32) {
        let _ = self.read_spare(layer, experts, current, Ahead::Prefetch);
    }

    /// As `prefetch`, for a prompt: its experts are nearly certain to be
    /// used, so they are not counted as prefetched (the gate judges the
    /// decode's predictions by what it prefetched).
    pub fn read_ahead(&self, layer: u32, experts: &[u32], current: u32) {
        let _ = self.read_spare(layer, experts, current, Ahead::Prompt);
    }

    /// A prompt group's ubatch routes to `experts` at `layer`, having
    /// computed `before` (the paged layer before, if any): reads ahead of
    /// the next layer leave room for what the group's ubatches still need
    /// at a layer, and may take the slots of what none of them needs any
    /// more (see `read_spare`).
    pub fn group_routes(&self, layer: u32, before: Option<u32>, experts: &[u32]) {
        self.shared.lock().group_routes.announce(layer, before, experts);
    }

    /// True if a prompt group's ubatch has announced its routes at `layer`.
    pub fn group_knows(&self, layer: u32) -> bool {
        self.shared.lock().group_routes.knows(layer)
    }

    /// The prompt group is computed: its routes are forgotten.
    pub fn group_ends(&self) {
        self.shared.lock().group_routes.clear();
    }

    /// A prompt group's ubatch has queued its misses at `layer`: starts
    /// reading, behind them, what the group's later ubatches route to at
    /// `layer` and is not in the arena, into slots no ubatch of the group
    /// still needs. Reads ahead of `layer` had only the slots the layer
    /// before left spare; without these, each later ubatch read the rest on
    /// demand, its compute waiting on them.
    pub fn read_group_owed(&self, layer: u32) {
        let sh = &*self.shared;
        let Some(ll) = sh.layout.layers.get(&layer) else { return };
        let mut jobs = Vec::new();
        let mut st = sh.lock();
        let owed = st.group_routes.still_needed_in_order(layer);
        let class = st.usable(&sh.arena, ll.class);
        let spare =
            |s: SlotId, st: &State| st.slots[s].pins == 0 && st.res.key(s).map_or(true, |k| k.layer != layer && !st.group_routes.needed(k.layer, k.expert));
        for e in owed {
            if st.res.slot_of(ExpertKey::new(layer, e)).is_some() {
                continue;
            }
            let Some(slot) = st.res.victim(layer, class.clone(), &|s| spare(s, &st)) else { break };
            jobs.extend(sh.start_ahead(&mut st, slot, ll, e, Ahead::Prompt));
        }
        drop(st);
        sh.submit(jobs, Lane::Spare);
    }

    /// A prompt's ubatch (or group) of `n_tokens` starts, and layers
    /// without paged experts (a model's dense leading layers) compute
    /// before the first paged layer's router has chosen: the disk would
    /// idle. Guesses, into spare slots, the experts that layer will route
    /// to: the ones earlier prompts routed most tokens to there, then the
    /// rest in order, as many as `n_tokens` would touch were the routing
    /// uniform. When the router has chosen (`first_layer_routed`), the
    /// guesses it did not choose are dropped if their reads are still
    /// queued, so that a wrong guess costs the disk only the time it would
    /// have idled. Only where the arena holds a layer's experts (a smaller
    /// one would evict what the layer needs). Returns the experts whose
    /// reads were started.
    pub fn read_before_routing(&self, n_tokens: u64, top_k: usize) -> usize {
        let Some((&layer, ll)) = self.shared.layout.layers.iter().next() else { return 0 };
        if layer == 0 || top_k == 0 || self.holds_every_expert() || !self.holds_a_layer() {
            return 0;
        }
        let likely = likely_touched(ll.n_expert, top_k, n_tokens);
        let experts: Vec<u32> = {
            let st = self.shared.lock();
            let tokens = |e: u32| st.first_layer_tokens.get(e as usize).copied().unwrap_or(0);
            let mut order: Vec<u32> = (0..ll.n_expert).collect();
            order.sort_by_key(|&e| std::cmp::Reverse(tokens(e)));
            order.truncate(likely);
            order.retain(|&e| st.res.slot_of(ExpertKey::new(layer, e)).is_none());
            order
        };
        let started = self.read_spare(layer, &experts, layer, Ahead::Guess);
        log::debug!("a prompt of {n_tokens} tokens: {started} experts of layer {layer} guessed before its router runs ({likely} likely)");
        started
    }

    /// A prompt's ubatch routed `tokens[e]` tokens to expert e of the first
    /// paged layer: guesses it did not choose whose reads are still queued
    /// are dropped, and the counts order the next prompt's guesses.
    pub fn first_layer_routed(&self, tokens: &[(u32, u64)]) {
        let sh = &*self.shared;
        let Some((&layer, ll)) = sh.layout.layers.iter().next() else { return };
        let mut st = sh.lock();
        if st.first_layer_tokens.len() < ll.n_expert as usize {
            st.first_layer_tokens.resize(ll.n_expert as usize, 0);
        }
        for &(e, n) in tokens.iter().filter(|&&(e, _)| e < ll.n_expert) {
            st.first_layer_tokens[e as usize] += n;
        }
        let chosen: std::collections::HashSet<u32> = tokens.iter().map(|&(e, _)| e).collect();
        let guessed: Vec<(SlotId, u32)> = st.res.held().filter(|&(s, k)| k.layer == layer && st.slots[s].guessed).map(|(s, k)| (s, k.expert)).collect();
        let mut dropped = 0;
        for (slot, e) in guessed {
            st.slots[slot].guessed = false;
            if !chosen.contains(&e) && !st.slots[slot].ready && sh.cancel_queued(&mut st, slot) {
                dropped += 1;
            }
        }
        if dropped > 0 {
            st.counts.get_mut(&layer).expect("layer counted").guesses_dropped += dropped;
            log::debug!("layer {layer}: {dropped} guessed experts the router did not choose were dropped before their reads");
            sh.changed.notify_all();
        }
    }

    /// Returns the experts whose reads it started.
    fn read_spare(&self, layer: u32, experts: &[u32], current: u32, kind: Ahead) -> usize {
        let sh = &*self.shared;
        let Some(ll) = sh.layout.layers.get(&layer) else { return 0 };
        let mut started = 0;
        let mut jobs = Vec::new();
        let mut st = sh.lock();
        let class = st.usable(&sh.arena, ll.class);
        // Not `layer`'s experts, nor `current`'s that the prompt group's
        // ubatches are still to use (all of them outside a group).
        let spare = |s: SlotId, st: &State| {
            st.slots[s].pins == 0
                && match st.res.key(s) {
                    Some(k) if k.layer == layer => false,
                    Some(k) if k.layer == current => st.group_routes.knows(current) && !st.group_routes.needed(current, k.expert),
                    _ => true,
                }
        };
        // Slots the group's ubatches still need at `current` and that are
        // not read yet are left to them: a read ahead taking the last
        // spare slots would have them evict this layer's experts (or the
        // ones read ahead), and read them again.
        let owed = match sh.layout.layers.get(&current) {
            Some(cl) if cl.class == ll.class => st.group_routes.still_needed(current).filter(|&e| st.res.slot_of(ExpertKey::new(current, e)).is_none()).count(),
            _ => 0,
        };
        let mut room = if owed == 0 { usize::MAX } else { class.clone().filter(|&s| spare(s, &st)).count().saturating_sub(owed) };
        for &e in experts.iter().filter(|&&e| e < ll.n_expert) {
            if st.res.slot_of(ExpertKey::new(layer, e)).is_some() {
                continue;
            }
            if room == 0 {
                break;
            }
            room -= 1;
            let victim = st.res.victim(layer, class.clone(), &|s| spare(s, &st));
            let Some(slot) = victim else { break };
            jobs.extend(sh.start_ahead(&mut st, slot, ll, e, kind));
            started += 1;
        }
        drop(st);
        sh.submit(jobs, Lane::Spare);
        started
    }
}

/// The experts `n_tokens` tokens choosing `top_k` of `n_expert` each would
/// touch at a layer if the router chose uniformly: n (1 - (1 - k/n)^t),
/// rounded up. A trained router's skew touches fewer; the excess is read
/// while the disk would otherwise idle.
fn likely_touched(n_expert: u32, top_k: usize, n_tokens: u64) -> usize {
    let n = f64::from(n_expert);
    let miss = (1.0 - (top_k as f64 / n).min(1.0)).powf(n_tokens as f64);
    ((n * (1.0 - miss)).ceil() as usize).min(n_expert as usize)
}

#[cfg(test)]
mod tests {
    use super::likely_touched;

    #[test]
    fn likely_touched_grows_with_the_tokens_to_every_expert() {
        assert_eq!(likely_touched(256, 8, 1), 8);
        assert_eq!(likely_touched(256, 8, 0), 0);
        assert_eq!(likely_touched(256, 8, 10), 70);
        assert_eq!(likely_touched(256, 8, 512), 256);
        assert_eq!(likely_touched(4, 8, 3), 4);
    }
}
