//! A prompt group's routing, layer by layer: which experts the group's
//! ubatches still need at a layer. Each ubatch's routing at layer L is
//! computed at the end of its piece before L (`experts_ahead`), and the
//! ubatches announce a layer in the same order as the one before it: the
//! k-th announcement at L means the k-th ubatch has computed the layer
//! before L. So an expert of that layer that no later ubatch routes to can
//! make room for reads ahead, while the layer's other ubatches compute.

use std::collections::{HashMap, HashSet};

#[derive(Debug, Default)]
pub struct GroupRoutes {
    /// By layer: each ubatch's experts, in the order they were announced.
    announced: HashMap<u32, Vec<Vec<u32>>>,
    /// By layer: how many of the group's ubatches still need each expert.
    owed: HashMap<u32, HashMap<u32, u32>>,
    /// By layer: how many ubatches have started computing its experts.
    started: HashMap<u32, usize>,
    /// The layer being computed, and what the group's ubatches after the
    /// one computing it route to there.
    later: Option<(u32, HashSet<u32>)>,
}

impl GroupRoutes {
    /// A ubatch routes to `experts` at `layer`; it has computed `before`
    /// (the paged layer before `layer`, if any), so its routes there are done.
    pub fn announce(&mut self, layer: u32, before: Option<u32>, experts: &[u32]) {
        let list = self.announced.entry(layer).or_default();
        let k = list.len();
        list.push(experts.to_vec());
        let owed = self.owed.entry(layer).or_default();
        for &e in experts {
            *owed.entry(e).or_default() += 1;
        }
        let Some(before) = before else { return };
        let Some(done) = self.announced.get(&before).and_then(|l| l.get(k)) else { return };
        let owed = self.owed.entry(before).or_default();
        for e in done {
            if let Some(n) = owed.get_mut(e) {
                *n = n.saturating_sub(1);
            }
        }
    }

    /// Whether the group's routes at `layer` are known.
    pub fn knows(&self, layer: u32) -> bool {
        self.owed.contains_key(&layer)
    }

    /// Whether a ubatch of the group is still to use `expert` at `layer`.
    pub fn needed(&self, layer: u32, expert: u32) -> bool {
        self.owed.get(&layer).and_then(|o| o.get(&expert)).is_some_and(|&n| n > 0)
    }

    /// The experts of `layer` a ubatch of the group is still to use.
    pub fn still_needed(&self, layer: u32) -> impl Iterator<Item = u32> + '_ {
        self.owed.get(&layer).into_iter().flat_map(|o| o.iter().filter(|(_, &n)| n > 0).map(|(&e, _)| e))
    }

    /// The experts of `layer` a ubatch of the group is still to use, each
    /// once, in the order the ubatches announced them: the next ubatch's
    /// first.
    pub fn still_needed_in_order(&self, layer: u32) -> Vec<u32> {
        let mut seen = std::collections::HashSet::new();
        let lists = self.announced.get(&layer).map_or(&[][..], |l| &l[..]);
        lists.iter().flatten().copied().filter(|&e| self.needed(layer, e) && seen.insert(e)).collect()
    }

    /// The group's next ubatch starts computing `layer`'s experts (the
    /// ubatches compute a layer in the order they announced it).
    pub fn batch_starts(&mut self, layer: u32) {
        // Outside a group (a decode step, a prompt of one ubatch) nothing is
        // announced, and nothing counted.
        let Some(lists) = self.announced.get(&layer) else {
            self.later = None;
            return;
        };
        let n = self.started.entry(layer).or_default();
        let later = lists.iter().skip(*n + 1).flatten().copied().collect();
        *n += 1;
        self.later = Some((layer, later));
    }

    /// The group's ubatches compute `layer`'s experts all at once (their
    /// expert ops shared): none of them needs one after.
    pub fn all_start(&mut self, layer: u32) {
        if let Some(owed) = self.owed.get_mut(&layer) {
            owed.values_mut().for_each(|n| *n = 0);
        }
        let n = self.announced.get(&layer).map_or(0, Vec::len);
        self.started.insert(layer, n);
        self.later = Some((layer, HashSet::new()));
    }

    /// Whether a ubatch after the one computing `layer` routes to `expert`
    /// there: reading a miss into its slot would have that ubatch read it
    /// again.
    pub fn needed_later(&self, layer: u32, expert: u32) -> bool {
        self.later.as_ref().is_some_and(|(l, set)| *l == layer && set.contains(&expert))
    }

    /// The group is computed.
    pub fn clear(&mut self) {
        self.announced.clear();
        self.owed.clear();
        self.started.clear();
        self.later = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expert_is_needed_until_the_last_ubatch_routed_to_it_is_past_its_layer() {
        let mut r = GroupRoutes::default();
        // Two ubatches at layer 3: the first routes to 1 and 2, the second to 2 and 5.
        r.announce(3, None, &[1, 2]);
        r.announce(3, None, &[2, 5]);
        assert!(r.knows(3) && !r.knows(4));
        // The first ubatch reaches layer 4: it is past layer 3.
        r.announce(4, Some(3), &[7]);
        assert!(!r.needed(3, 1) && r.needed(3, 2) && r.needed(3, 5));
        let mut left: Vec<u32> = r.still_needed(3).collect();
        left.sort();
        assert_eq!(left, [2, 5]);
        assert_eq!(r.still_needed_in_order(3), [2, 5]);
        assert_eq!(r.still_needed_in_order(4), [7]);
        r.announce(4, Some(3), &[8]);
        // The first ubatch computes layer 4: the second's 8 is needed later,
        // its own 7 not; then the second computes it, and none is.
        r.batch_starts(4);
        assert!(r.needed_later(4, 8) && !r.needed_later(4, 7) && !r.needed_later(3, 2));
        r.batch_starts(4);
        assert!(!r.needed_later(4, 8));
        assert_eq!(r.still_needed(3).count(), 0);
        assert!(r.needed(4, 7) && r.needed(4, 8));
        r.clear();
        assert!(!r.knows(4));
    }

    #[test]
    fn a_layer_computed_for_the_whole_group_is_needed_by_none() {
        let mut r = GroupRoutes::default();
        r.announce(3, None, &[1, 2]);
        r.announce(3, None, &[2, 5]);
        r.all_start(3);
        assert!(r.knows(3) && !r.needed(3, 2) && !r.needed_later(3, 5));
        assert_eq!(r.still_needed(3).count(), 0);
        // The ubatches then announce the next layer, past this one.
        r.announce(4, Some(3), &[7]);
        r.announce(4, Some(3), &[8]);
        assert!(!r.needed(3, 1) && r.needed(4, 7));
    }
}
