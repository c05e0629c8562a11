//! A prompt's ubatches computed together, layer by layer across them
//! (patch 0013, `shim/sdq-pieces.h`): the group being computed, and what the
//! groups added up to. A group is one step: its first ubatch's first paged
//! layer starts the step with all of the group's tokens, and its last
//! ubatch's last paged layer ends it, so the phases and the `-ub` hint see a
//! group as one batch.
//!
//! Where the arena is smaller than a layer's experts, a group's ubatches
//! share their expert ops: the first ubatch's op computes the layer's
//! experts for all of them, each expert read once, and keeps each later
//! ubatch's output (its op's size) for that ubatch's op to copy. Those
//! outputs are memory the group holds, counted with what it stages.

/// The group being computed.
#[derive(Clone, Copy, Debug)]
struct Group {
    ubatches: u32,
    tokens: u64,
    started: u32,
    ended: u32,
    shares: bool,
}

/// Groups computed so far, and the one in progress.
#[derive(Debug, Default)]
pub struct Groups {
    current: Option<Group>,
    /// Whether the group being staged shares its expert ops.
    staging_shares: bool,
    counts: GroupCounts,
}

/// What the groups added up to (the stats file's `prompt_groups`).
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupCounts {
    /// Groups computed, and the ubatches in them.
    pub computed: u64,
    pub ubatches: u64,
    /// The most a group's staged ubatches held (graphs and what they keep
    /// aside between pieces).
    pub peak_bytes: u64,
    /// Batches whose first ubatch found no room to start a group (computed
    /// one ubatch at a time).
    pub refused: u64,
    /// The most the arena lent a group's staged ubatches.
    pub lent_bytes: u64,
    /// Groups whose ubatches shared their expert ops, and the layers whose
    /// experts a first ubatch's op computed for its whole group.
    pub shared: u64,
    pub shared_layers: u64,
    /// The most ubatches like those of the last batch staged that a group
    /// could hold in the room it had then (0 before any was; 1 where none
    /// fits): a larger
    /// `-b` than that many ubatches is cut into several groups, each
    /// reading its experts again.
    pub capacity: u32,
}

impl Groups {
    /// The next `ubatches` ubatches (`tokens` tokens) are computed
    /// together, staged in `bytes`; a group that shares its expert ops also
    /// keeps `op_out` for each ubatch after the first.
    pub fn begin(&mut self, ubatches: u32, tokens: u64, bytes: u64, op_out: u64) {
        let shares = self.staging_shares;
        let kept = if shares { op_out * u64::from(ubatches.saturating_sub(1)) } else { 0 };
        self.counts.peak_bytes = self.counts.peak_bytes.max(bytes + kept);
        self.current = Some(Group { ubatches, tokens, started: 0, ended: 0, shares });
        self.counts.computed += 1;
        self.counts.ubatches += u64::from(ubatches);
        self.counts.shared += u64::from(shares);
    }

    /// The group being staged shares its expert ops (`shares`), or not:
    /// decided when its first ubatch is staged.
    pub fn stage(&mut self, shares: bool) {
        self.staging_shares = shares;
    }

    /// Whether the group being staged shares its expert ops.
    pub fn staging_shares(&self) -> bool {
        self.staging_shares
    }

    /// Whether the group being computed shares its expert ops.
    pub fn shares(&self) -> bool {
        self.current.is_some_and(|g| g.shares)
    }

    /// A first ubatch's op computed a layer's experts for its whole group.
    pub fn layer_shared(&mut self) {
        self.counts.shared_layers += 1;
    }

    /// Whether a group whose `n_staged` ubatches hold `bytes` may stage
    /// another within `allowance` bytes (the next about as large as the
    /// ones before). With `n_staged` 0, `bytes` are what the first would
    /// hold: it is staged only where a second fits too (a group of one
    /// reads nothing less than stock's order and holds more). A group that
    /// shares its expert ops also holds `op_out` for each ubatch after the
    /// first.
    pub fn room(&mut self, n_staged: u32, bytes: u64, op_out: u64, allowance: u64) -> bool {
        let room = self.staging_needs(n_staged, bytes, op_out) <= allowance;
        // The capacity is of a batch's ubatches once some are staged: a
        // batch of one small ubatch (a prompt's tail) says nothing of the
        // full ones a larger -b would be made of, unless even it has no room.
        if n_staged > 0 || !room {
            let per_ubatch = bytes / u64::from(n_staged.max(1));
            self.counts.capacity = Self::capacity(per_ubatch, self.kept_out(op_out), allowance);
        }
        if !room && n_staged == 0 {
            self.counts.refused += 1;
        }
        room
    }

    /// `needs` for the group being staged: `op_out` counts only where it
    /// shares its expert ops.
    pub fn staging_needs(&self, n_staged: u32, bytes: u64, op_out: u64) -> u64 {
        Self::needs(n_staged, bytes, self.kept_out(op_out))
    }

    /// What the group being staged keeps of each later ubatch's op output:
    /// all of it where it shares its expert ops, else nothing.
    fn kept_out(&self, op_out: u64) -> u64 {
        if self.staging_shares {
            op_out
        } else {
            0
        }
    }

    /// What a group whose `n_staged` ubatches hold `bytes` holds once it
    /// stages one more, about as large as those before, with `op_out` kept
    /// for each ubatch after the first.
    pub fn needs(n_staged: u32, bytes: u64, op_out: u64) -> u64 {
        let next = if n_staged == 0 { bytes } else { bytes / u64::from(n_staged) };
        bytes + next + op_out * u64::from(n_staged.max(1))
    }

    /// The most ubatches of `per_ubatch` bytes each, keeping `op_out` for
    /// each after the first, that `room` lets one group stage in
    /// `allowance`; under 2, no group.
    pub fn capacity(per_ubatch: u64, op_out: u64, allowance: u64) -> u32 {
        // m ubatches hold per_ubatch·m + op_out·(m − 1) once the last is
        // staged (`needs` of the m − 1 before it), and m = 2 is also what
        // `room` asks of a first ubatch.
        let m = (allowance + op_out) / (per_ubatch + op_out).max(1);
        if m < 2 {
            return 1;
        }
        m.min(u64::from(u32::MAX)) as u32
    }

    /// The arena lends the group `bytes` in all.
    pub fn lent(&mut self, bytes: u64) {
        self.counts.lent_bytes = self.counts.lent_bytes.max(bytes);
    }

    pub fn counts(&self) -> GroupCounts {
        self.counts
    }

    /// The group is computed (or failed): steps are ubatches again.
    pub fn end(&mut self) {
        self.current = None;
    }

    /// A ubatch of `n_tokens` reaches the first paged layer: the tokens its
    /// step counts, or None inside a group whose step has started.
    pub fn step_starts(&mut self, n_tokens: u64) -> Option<u64> {
        let Some(g) = &mut self.current else { return Some(n_tokens) };
        g.started += 1;
        (g.started == 1).then_some(g.tokens)
    }

    /// A ubatch leaves the last paged layer: true if that ends its step (a
    /// group's step ends with its last ubatch).
    pub fn step_ends(&mut self) -> bool {
        let Some(g) = &mut self.current else { return true };
        g.ended += 1;
        g.ended >= g.ubatches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_one_step() {
        let mut g = Groups::default();
        assert_eq!(g.step_starts(7), Some(7));
        assert!(g.step_ends());
        g.begin(3, 1200, 0, 0);
        // Layer by layer: all three start before any ends.
        assert_eq!((g.step_starts(512), g.step_starts(512), g.step_starts(176)), (Some(1200), None, None));
        assert_eq!((g.step_ends(), g.step_ends(), g.step_ends()), (false, false, true));
        g.end();
        assert_eq!(g.step_starts(1), Some(1));
        assert!(g.step_ends());
        assert_eq!((g.counts.computed, g.counts.ubatches), (1, 3));
    }

    #[test]
    fn a_group_stages_what_its_allowance_holds() {
        // The first counts twice (a group of one is not staged); the next
        // is taken as large as the average of those before.
        assert_eq!((Groups::needs(0, 10, 0), Groups::needs(3, 30, 0)), (20, 40));
        let mut g = Groups::default();
        // Ubatches of 10 bytes in 35: three fit, a fourth would not.
        assert!(g.room(0, 10, 5, 35) && g.room(1, 10, 5, 35) && g.room(2, 20, 5, 35));
        assert!(!g.room(3, 30, 5, 35));
        assert_eq!(g.counts.capacity, 3);
        // The three staged hold 32 once the last is: its peak, as it begins.
        assert_eq!(g.counts.peak_bytes, 0);
        g.begin(3, 1200, 32, 5);
        assert_eq!(g.counts.peak_bytes, 32);
    }

    #[test]
    fn a_group_that_shares_its_expert_ops_holds_each_later_ubatchs_output() {
        // Two ubatches of 10 bytes and one output of 5 kept: 25; three, 40.
        assert_eq!((Groups::needs(0, 10, 5), Groups::needs(1, 10, 5), Groups::needs(2, 20, 5)), (25, 25, 40));
        let mut g = Groups::default();
        g.stage(true);
        assert!(g.room(0, 10, 5, 35) && g.room(1, 10, 5, 35) && !g.room(2, 20, 5, 35));
        assert_eq!(g.counts.capacity, 2);
        // The two staged, and the second's output kept.
        g.begin(2, 1024, 20, 5);
        assert_eq!(g.counts.peak_bytes, 25);
        assert!(g.shares());
        g.layer_shared();
        g.end();
        assert!(!g.shares());
        assert_eq!((g.counts.shared, g.counts.shared_layers), (1, 1));
    }

    #[test]
    fn a_group_starts_only_where_two_ubatches_fit() {
        let mut g = Groups::default();
        // 20 bytes each in 35: the first is not staged (the batch is
        // computed as stock), and is no peak.
        assert!(!g.room(0, 20, 0, 35));
        assert_eq!((g.counts.peak_bytes, g.counts.refused, g.counts.capacity), (0, 1, 1));
        assert!(g.room(0, 17, 0, 35));
        assert_eq!(g.counts.refused, 1);
    }

    #[test]
    fn capacity_is_what_room_lets_one_group_stage() {
        let small = (1..12u64).flat_map(|per| (0..6u64).flat_map(move |out| (0..60u64).map(move |a| (per, out, a))));
        for (per, out, allowance) in [(10, 0, 35), (10, 5, 35), (7, 3, 100), (20, 0, 35), (10, 0, 19), (1, 0, 1000), (64, 9, 640)].into_iter().chain(small) {
            let cap = Groups::capacity(per, out, allowance);
            let mut g = Groups::default();
            g.stage(out > 0);
            let staged = (0..).take_while(|&n| g.room(n, per * u64::from(n.max(1)), out, allowance)).count() as u32;
            assert_eq!(cap, staged.max(1), "{per} B per ubatch, {out} kept, in {allowance}");
        }
        // A group of three ubatches of 10 in 35, then a prompt's tail of a
        // few tokens, its own batch: a group still holds three full ones.
        let mut g = Groups::default();
        assert!(g.room(0, 10, 0, 35) && g.room(1, 10, 0, 35) && g.room(2, 20, 0, 35) && !g.room(3, 30, 0, 35));
        assert!(g.room(0, 2, 0, 35));
        assert_eq!(g.counts.capacity, 3);
    }
}
