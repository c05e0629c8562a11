//! Filling the arena ahead of need: reading every expert when the arena
//! holds them all (stock's readahead of a mapped model), a hot set's experts
//! from a previous run, and keeping those reads off a step's path.

use super::*;

impl Pager {
    /// Starts reading every expert not yet in the arena into a free slot, in
    /// file order (layer by layer), at low priority: behind every demand
    /// read, and a use that finds one still queued moves it to the front.
    /// For an arena that holds every expert, this is stock's readahead of
    /// the mapped model: the arena fills from the first token on instead of
    /// expert by expert as the router first picks each. Returns the number
    /// of experts queued.
    pub fn preload(&self) -> usize {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let mut free: Vec<std::collections::VecDeque<SlotId>> =
            (0..sh.arena.classes().len()).map(|c| st.usable(&sh.arena, c).filter(|&s| st.res.key(s).is_none() && st.slots[s].pins == 0).collect()).collect();
        let mut jobs = Vec::new();
        let mut queued = 0;
        for ll in sh.layout.layers.values() {
            for e in 0..ll.n_expert {
                if st.res.slot_of(ExpertKey::new(ll.layer, e)).is_some() {
                    continue;
                }
                let Some(slot) = free[ll.class].pop_front() else { break };
                let evicted = st.res.fill(slot, ExpertKey::new(ll.layer, e));
                jobs.extend(sh.start_load(&mut st, slot, ll, e, evicted, false));
                st.slots[slot].prefetched = true;
                st.counts.get_mut(&ll.layer).expect("layer counted").preloaded += 1;
                queued += 1;
            }
        }
        drop(st);
        sh.submit(jobs, Lane::Spare);
        queued
    }

    /// Starts warm from a hot set: the policy learns `counts`, and the
    /// experts of `held` (a previous run's arena) are listed for reading,
    /// the most used first where the arena's free slots cannot take them
    /// all, then in file-offset order. They are read between steps only,
    /// at the lowest priority (see `Queue::warm`). Returns how many are listed.
    pub fn warm(&self, counts: &[(ExpertKey, f64)], held: &[ExpertKey]) -> usize {
        let sh = &*self.shared;
        let st = {
            let mut st = sh.lock();
            st.res.learn(counts);
            st
        };
        let count: HashMap<ExpertKey, f64> = counts.iter().copied().collect();
        let mut wanted: Vec<ExpertKey> = held.iter().copied().filter(|k| sh.layout.layers.get(&k.layer).is_some_and(|l| k.expert < l.n_expert)).collect();
        wanted.sort_by(|a, b| count.get(b).unwrap_or(&0.0).total_cmp(count.get(a).unwrap_or(&0.0)).then(a.cmp(b)));
        let mut room: Vec<usize> = (0..sh.arena.classes().len()).map(|c| st.usable(&sh.arena, c).filter(|&s| st.res.key(s).is_none()).count()).collect();
        wanted.retain(|&k| {
            let class = sh.layout.layers[&k.layer].class;
            let fits = st.res.slot_of(k).is_none() && room[class] > 0;
            room[class] -= usize::from(fits);
            fits
        });
        drop(st);
        // In file order (by each expert's first part), which the disk reads best.
        wanted.sort_by_cached_key(|&key| {
            let first = &sh.layout.layers[&key.layer].parts[0];
            (first.path.clone(), first.file_offset(key.expert))
        });
        let n = wanted.len();
        let mut q = sh.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.warm.extend(wanted);
        drop(q);
        for _ in 0..WARM_READERS {
            sh.queued.notify_one();
        }
        n
    }

    /// A step's paged layers start being computed: a warm start's reads wait.
    pub fn step_started(&self) {
        log::trace!("step started");
        self.shared.queue.lock().unwrap_or_else(|p| p.into_inner()).in_step = true;
    }

    /// A step's paged layers are computed: a warm start's reads may go on.
    pub fn step_ended(&self) {
        log::trace!("step ended");
        let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.in_step = false;
        let waiting = !q.warm.is_empty();
        drop(q);
        if waiting {
            for _ in 0..WARM_READERS {
                self.shared.queued.notify_one();
            }
        }
    }

    /// What a warm start needs at exit: the policy's counts, and the
    /// experts fully read into the arena.
    pub fn hot_set(&self) -> (Vec<(ExpertKey, f64)>, Vec<ExpertKey>) {
        let st = self.shared.lock();
        let held = st.res.held().filter(|&(s, _)| st.slots[s].ready).map(|(_, k)| k).collect();
        (st.res.counts(), held)
    }
}
