//! An expert's chance of use at its layer's next batches, learned from the
//! run's own routing (`ReuseTable`), and what `Freq` keeps to score its
//! slots by it (`Reuse`).
//!
//! Why not the count alone: on a trained model's routing an expert just
//! used comes back at its layer's next batch far more often than its count
//! says (one used once, 0.20 against a count's 0.01; one of a count above
//! eight, 0.49 against 0.09), and less often once a few tokens have passed.
//! The count is the rate once that burst is over. The table learns by how
//! much to scale the count's rate, by recency and count, as the run goes,
//! from its single-token batches; every cell starts at 1, with nothing
//! fitted to one model.

use super::ExpertKey;

/// Recency buckets: batches of its layer from the last use to the batch
/// judged, 1 to `SINCE_BUCKETS` (the last holds everything older).
const SINCE_BUCKETS: usize = 8;
/// Count buckets, by powers of two: below 0.5, below 1, 2, 4, 8, 16, and
/// the rest.
const COUNT_BUCKETS: usize = 7;
/// Uses a cell starts with, as many as the count expects: a cell that has
/// seen fewer leans on the count's rate.
const PRIOR_USES: f64 = 5.0;

/// Per cell (recency, count bucket): uses seen, and the uses the counts'
/// rates expected in the same batches. Their ratio scales the count's rate.
#[derive(Clone, Debug)]
pub struct ReuseTable {
    used: [[f64; COUNT_BUCKETS]; SINCE_BUCKETS],
    expected: [[f64; COUNT_BUCKETS]; SINCE_BUCKETS],
    /// (used + prior) / (expected + prior), kept as they change.
    factor: [[f64; COUNT_BUCKETS]; SINCE_BUCKETS],
    /// The chance per batch a count of one stands for (ln 2 / half-life).
    rate_per_count: f64,
}

fn since_bucket(since: u64) -> usize {
    (since.clamp(1, SINCE_BUCKETS as u64) - 1) as usize
}

fn count_bucket(count: f64) -> usize {
    let mut bucket = 0;
    let mut edge = 0.5;
    while bucket + 1 < COUNT_BUCKETS && count >= edge {
        bucket += 1;
        edge *= 2.0;
    }
    bucket
}

impl ReuseTable {
    /// An empty table for counts that halve every `half_life` batches.
    pub fn new(half_life: f64) -> ReuseTable {
        ReuseTable {
            used: [[0.0; COUNT_BUCKETS]; SINCE_BUCKETS],
            expected: [[0.0; COUNT_BUCKETS]; SINCE_BUCKETS],
            factor: [[1.0; COUNT_BUCKETS]; SINCE_BUCKETS],
            rate_per_count: std::f64::consts::LN_2 / half_life,
        }
    }

    /// The chance per batch the count alone gives.
    fn rate(&self, count: f64) -> f64 {
        (count * self.rate_per_count).clamp(1e-6, 1.0)
    }

    /// An expert last used `since` of its layer's batches before a batch,
    /// of aged count `count`, was (or was not) used in it.
    pub fn observe(&mut self, since: u64, count: f64, used: bool) {
        let (s, c) = (since_bucket(since), count_bucket(count));
        self.expected[s][c] += self.rate(count);
        if used {
            self.used[s][c] += 1.0;
        }
        self.factor[s][c] = (self.used[s][c] + PRIOR_USES) / (self.expected[s][c] + PRIOR_USES);
    }

    /// The chance an expert of count `count` is used in the batch of its
    /// layer `since` batches after its last use: the count's rate, scaled
    /// by its cell (which keeps the order of counts within a cell).
    #[cfg(test)]
    pub fn chance(&self, since: u64, count: f64) -> f64 {
        self.chances(count)(since)
    }

    /// `chance` for one count, at any recency: the count's bucket and rate
    /// found once, for a scan of its layer's runs.
    pub fn chances(&self, count: f64) -> impl Fn(u64) -> f64 + '_ {
        let (c, rate) = (count_bucket(count), self.rate(count));
        move |since| (rate * self.factor[since_bucket(since)][c]).min(1.0)
    }
}

/// What `Freq::with_reuse` keeps beside its counts: each expert's last
/// use, the table, and the batch under way, which the table learns from
/// once it is done.
#[derive(Clone, Debug)]
pub struct Reuse {
    pub table: ReuseTable,
    /// Per layer, per expert: the layer's batch of its last use (0: never).
    last: Vec<Vec<u64>>,
    /// Experts a token takes in a layer (0: not known, every batch learned from).
    top_k: usize,
    batch: Option<Batch>,
}

/// The batch under way: its layer, its index among the layer's batches,
/// and per expert used so far, its last use and count before it.
type Batch = (u32, u64, Vec<(u64, f64)>);

impl Reuse {
    pub fn new(half_life: f64, top_k: usize) -> Reuse {
        Reuse { table: ReuseTable::new(half_life), last: Vec::new(), top_k, batch: None }
    }

    /// Batch `index` of `layer` begins.
    pub fn begin_batch(&mut self, layer: u32, index: u64) {
        self.batch = Some((layer, index, Vec::new()));
    }

    /// The layer of the batch under way.
    pub fn batch_layer(&self) -> Option<u32> {
        self.batch.as_ref().map(|b| b.0)
    }

    /// `key`'s layer's last batch it was used in (0: never).
    pub fn last_use(&self, key: ExpertKey) -> u64 {
        self.last.get(key.layer as usize).and_then(|v| v.get(key.expert as usize)).copied().unwrap_or(0)
    }

    /// The batch under way uses `key`, whose count was `count` before it.
    pub fn used(&mut self, key: ExpertKey, count: f64) {
        let Some((_, index, used)) = self.batch.as_mut().filter(|b| b.0 == key.layer) else { return };
        let last = super::expert_cell(&mut self.last, key);
        if *last != *index {
            used.push((*last, count));
            *last = *index;
        }
    }

    /// The batch under way is done: the table learns, for each expert of
    /// its layer with a past, whether it came back in it (`count` gives an
    /// expert's count now). A batch of more experts than a token takes is
    /// left out: a prompt's union says little of what a token uses next.
    pub fn close_batch(&mut self, count: impl Fn(u32) -> f64) {
        let Some((layer, index, used)) = self.batch.take() else { return };
        if self.top_k > 0 && used.len() > self.top_k {
            return;
        }
        for &(last, c) in &used {
            if last > 0 {
                self.table.observe(index - last, c, true);
            }
        }
        for (e, &last) in self.last.get(layer as usize).into_iter().flatten().enumerate() {
            if last > 0 && last < index {
                self.table.observe(index - last, count(e as u32), false);
            }
        }
    }

    /// How many tokens' experts `slots` slots of a class shared by
    /// `sharers` layers hold.
    pub fn horizon(&self, slots: usize, sharers: usize) -> f64 {
        slots as f64 / (sharers.max(1) * self.top_k.max(1)) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_starts_at_the_count_and_learns_a_burst() {
        let mut t = ReuseTable::new(64.0);
        let rate = std::f64::consts::LN_2 / 64.0;
        assert!((t.chance(1, 1.0) - rate).abs() < 1e-12, "unlearned, a cell is the count's rate");
        for i in 0..1000 {
            t.observe(1, 1.0, i % 4 == 0);
            t.observe(8, 1.0, i % 500 == 0);
        }
        assert!(t.chance(1, 1.0) > 0.15 && t.chance(30, 1.0) < rate, "{} {}", t.chance(1, 1.0), t.chance(30, 1.0));
        // Within a cell the count still orders: 1.5 is likelier than 1.
        assert!(t.chance(1, 1.5) > t.chance(1, 1.0));
        assert_eq!(t.chance(1, 1e9), 1.0);
        assert_eq!((count_bucket(0.1), count_bucket(0.5), count_bucket(1.0), count_bucket(100.0)), (0, 1, 2, COUNT_BUCKETS - 1));
        assert_eq!((since_bucket(0), since_bucket(1), since_bucket(99)), (0, 0, SINCE_BUCKETS - 1));
    }

    #[test]
    fn a_batch_teaches_the_table_unless_it_is_a_prompts() {
        let mut r = Reuse::new(64.0, 2);
        // Batch 1 of layer 0 uses experts 0 and 1; batch 2 uses 0 and 2.
        r.begin_batch(0, 1);
        r.used(ExpertKey::new(0, 0), 0.0);
        r.used(ExpertKey::new(0, 1), 0.0);
        r.close_batch(|_| 1.0);
        r.begin_batch(0, 2);
        r.used(ExpertKey::new(0, 0), 1.0);
        r.used(ExpertKey::new(0, 0), 1.0);
        r.used(ExpertKey::new(0, 2), 0.0);
        r.close_batch(|_| 1.0);
        // Expert 0 came back after one batch, expert 1 did not.
        let rate = r.table.rate(1.0);
        assert_eq!((r.table.expected[0][2], r.table.used[0][2]), (2.0 * rate, 1.0));
        assert_eq!(
            (r.last_use(ExpertKey::new(0, 0)), r.last_use(ExpertKey::new(0, 1)), r.last_use(ExpertKey::new(0, 2)), r.last_use(ExpertKey::new(1, 0))),
            (2, 1, 2, 0)
        );
        // Three experts in a batch of a top-2 model: a prompt's, not learned.
        r.begin_batch(0, 3);
        for e in [0, 1, 3] {
            r.used(ExpertKey::new(0, e), 1.0);
        }
        r.close_batch(|_| 1.0);
        assert_eq!(r.table.expected.iter().flatten().sum::<f64>(), 2.0 * rate);
        assert_eq!(r.last_use(ExpertKey::new(0, 3)), 3, "its uses still count as uses");
        assert_eq!(r.horizon(8, 1), 4.0);
    }
}
