//! Reads ahead: experts a later layer (or a prompt group's later ubatch)
//! will need, read at low priority into slots nobody is about to use, so
//! that they arrive while the layer before computes.

use super::readers::Job;
use super::{ExpertKey, Lane, Pager, Shared, SlotId, State};

/// A prompt's read ahead of `layer` (while `current` computes) that found
/// no spare slot for `experts`: continued, best first, as slots are released.
#[derive(Debug)]
pub(super) struct AheadRest {
    pub(super) layer: u32,
    pub(super) current: u32,
    pub(super) experts: Vec<u32>,
}

impl Pager {
    /// A decode step predicts that `layer` will use `experts`: the ones the
    /// arena does not hold are what a prefetch would read, and `layer`'s
    /// next batch judges them (`LayerCounts::prediction_held`), read or
    /// not, for the gate.
    pub fn predicted(&self, layer: u32, experts: &[u32]) {
        let mut st = self.shared.lock();
        let absent = experts.iter().copied().filter(|&e| st.res.slot_of(ExpertKey::new(layer, e)).is_none()).collect();
        st.prediction = Some((layer, absent));
    }

    /// Starts reading the experts of `layer` in `experts` (best first) that
    /// are not in the arena, at low priority, while layer `current` is being
    /// computed. A victim must be unpinned and hold no expert of `current` or
    /// `layer`; it stops at the first expert with no such slot.
    pub fn prefetch(&self, layer: u32, experts: &[u32], current: u32) {
        self.read_spare(layer, experts, current, false);
    }

    /// As `prefetch`, for a prompt: its experts are nearly certain to be
    /// used, so they are not counted as prefetched (the gate judges the
    /// decode's predictions by what it prefetched).
    pub fn read_ahead(&self, layer: u32, experts: &[u32], current: u32) {
        self.read_spare(layer, experts, current, true);
    }

    /// A prompt group's ubatch routes to `experts` at `layer`, having
    /// computed `before` (the paged layer before, if any): reads ahead of
    /// the next layer leave room for what the group's ubatches still need
    /// at a layer, and may take the slots of what none of them needs any
    /// more (see `read_spare`).
    pub fn group_routes(&self, layer: u32, before: Option<u32>, experts: &[u32]) {
        self.shared.lock().group_routes.announce(layer, before, experts);
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
            jobs.extend(sh.start_ahead(&mut st, slot, ll, e, true));
        }
        drop(st);
        sh.submit(jobs, Lane::Spare);
    }

    fn read_spare(&self, layer: u32, experts: &[u32], current: u32, for_prompt: bool) {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let (jobs, started) = sh.spare_reads(&mut st, layer, experts, current, for_prompt);
        // A prompt's experts are nearly certain to be used: the rest are
        // read as the batch computing now releases its slots. A decode's
        // prediction is read only as far as spare slots go.
        if for_prompt && started < experts.len() {
            st.ahead_rest.retain(|r| r.layer != layer);
            st.ahead_rest.push(AheadRest { layer, current, experts: experts[started..].to_vec() });
        }
        drop(st);
        sh.submit(jobs, Lane::Spare);
    }
}

impl Shared {
    /// Starts reading the experts of `layer` in `experts` that are not in
    /// the arena into spare slots (see `Pager::prefetch`), in order, until
    /// one finds none. Returns the jobs and how many of `experts` it got
    /// through.
    fn spare_reads(&self, st: &mut State, layer: u32, experts: &[u32], current: u32, for_prompt: bool) -> (Vec<Job>, usize) {
        let Some(ll) = self.layout.layers.get(&layer) else { return (Vec::new(), experts.len()) };
        let mut jobs = Vec::new();
        let class = st.usable(&self.arena, ll.class);
        // Not `layer`'s experts, nor `current`'s that the prompt group's
        // ubatches are still to use (all of them outside a group), nor one a
        // batch has yet to pin.
        let spare = |s: SlotId, st: &State| {
            st.unclaimed(s)
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
        let owed = match self.layout.layers.get(&current) {
            Some(cl) if cl.class == ll.class => st.group_routes.still_needed(current).filter(|&e| st.res.slot_of(ExpertKey::new(current, e)).is_none()).count(),
            _ => 0,
        };
        let mut room = if owed == 0 { usize::MAX } else { class.clone().filter(|&s| spare(s, st)).count().saturating_sub(owed) };
        for (i, &e) in experts.iter().enumerate() {
            if e >= ll.n_expert || st.res.slot_of(ExpertKey::new(layer, e)).is_some() {
                continue;
            }
            let victim = if room == 0 { None } else { st.res.victim(layer, class.clone(), &|s| spare(s, st)) };
            let Some(slot) = victim else { return (jobs, i) };
            room -= 1;
            jobs.extend(self.start_ahead(st, slot, ll, e, for_prompt));
        }
        (jobs, experts.len())
    }

    /// A slot was released: starts the reads it makes room for. First the
    /// misses of the batch being computed that `prepare` found no slot for
    /// (`State::pending`), into a slot the batch is done with and no later
    /// ubatch of its group needs (else its acquire reads it, as before);
    /// then a prompt's reads ahead of the next layer
    /// (`State::ahead_rest`), into spare slots. So the disk reads while the
    /// batch computes, rather than while a thread waits for the expert it
    /// came to. Returns the demand and the spare jobs.
    pub(super) fn refill(&self, st: &mut State) -> (Vec<Job>, Vec<Job>) {
        let mut demand = Vec::new();
        while let Some(&key) = st.pending.front() {
            if st.res.slot_of(key).is_some() {
                // Read already, or being read (its acquire came first).
                st.pending.pop_front();
                continue;
            }
            let ll = &self.layout.layers[&key.layer];
            let class = st.usable(&self.arena, ll.class);
            let Some(victim) = st.spare_victim(key.layer, class) else {
                return (demand, Vec::new());
            };
            st.pending.pop_front();
            let evicted = st.res.fill(victim, key);
            st.res.used(victim);
            demand.extend(self.start_load(st, victim, ll, key.expert, evicted, false));
            st.slots[victim].awaiting = true;
        }
        let mut spare = Vec::new();
        while let Some(rest) = st.ahead_rest.pop() {
            let (jobs, started) = self.spare_reads(st, rest.layer, &rest.experts, rest.current, true);
            spare.extend(jobs);
            if started < rest.experts.len() {
                st.ahead_rest.push(AheadRest { experts: rest.experts[started..].to_vec(), ..rest });
                break;
            }
        }
        (demand, spare)
    }
}
