//! The reader threads and what they share with the pager: the queue of
//! read jobs (demand first, then prefetches, then a warm start's experts),
//! reading an expert's parts into its slot, and faulting in the arena's
//! pages between steps.

use super::*;

/// Which of the queue's lanes a job goes to.
#[derive(Clone, Copy)]
pub(super) enum Lane {
    /// A batch waits for it.
    Demand,
    /// A prefetch: read only when no demand read waits.
    Spare,
}

/// Readers that may read a warm start's experts at once.
pub(super) const WARM_READERS: usize = 2;

/// Read jobs: demand reads (a batch waits for them) first, then prefetches,
/// then a warm start's experts.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) demand: VecDeque<Job>,
    pub(super) spare: VecDeque<Job>,
    /// A warm start's experts not read yet, in file order: read only
    /// between steps (`Pager::step_started`, `step_ended`) when no other
    /// read waits, by at most `WARM_READERS` readers, each into a free slot
    /// taken when its read starts, so that a warm start takes neither the
    /// disk, the cores nor a slot from a batch.
    pub(super) warm: VecDeque<ExpertKey>,
    /// Warm-start experts being read.
    pub(super) warm_reading: usize,
    /// A step's paged layers are being computed.
    pub(super) in_step: bool,
    pub(super) closed: bool,
}

/// One part of one expert to read into a slot.
pub(super) struct Job {
    pub(super) slot: SlotId,
    pub(super) layer: u32,
    pub(super) expert: u32,
    pub(super) part: usize,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock aborts the process (panic = abort),
        // so a poisoned lock cannot be observed; recover the guard regardless.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(st).unwrap_or_else(|p| p.into_inner())
    }

    /// As `wait`, for a compute thread that needs an expert of `layer` (its
    /// read, or a slot to read it into): the time counts as the layer's.
    pub(super) fn wait_for_read<'a>(&self, st: MutexGuard<'a, State>, layer: u32) -> MutexGuard<'a, State> {
        let since = Instant::now();
        let mut st = self.wait(st);
        if let Some(c) = st.counts.get_mut(&layer) {
            c.waited_us += since.elapsed().as_micros() as u64;
        }
        st
    }

    /// Starts reading `expert` into `slot`, which the residency has just
    /// given it (it held `evicted`): pinned by the load until every part is
    /// read. Returns the read jobs.
    pub(super) fn start_load(&self, st: &mut State, slot: SlotId, ll: &LayerLayout, expert: u32, evicted: Option<ExpertKey>, keep_pin: bool) -> Vec<Job> {
        debug_assert_eq!(st.res.key(slot), Some(ExpertKey::new(ll.layer, expert)));
        if let Some(old) = evicted {
            if st.slots[slot].prefetched {
                st.counts.get_mut(&old.layer).expect("layer counted").prefetch_wasted += 1;
            }
        }
        debug_assert!(!st.slots[slot].retired, "slot {slot} is retired");
        let class = self.arena.class_of(slot);
        let reached = slot - self.arena.classes()[class].first + 1;
        if reached > st.filled[class] {
            st.filled[class] = reached;
        }
        st.slots[slot] = Slot {
            pins: 1,
            ready: false,
            parts_left: ll.parts.len() as u32,
            failed: false,
            started: Some(Instant::now()),
            batch: None,
            keep_pin,
            prefetched: false,
            prompt_ahead: false,
            awaiting: false,
            retired: false,
        };
        (0..ll.parts.len()).map(|part| Job { slot, layer: ll.layer, expert, part }).collect()
    }

    /// Starts reading `expert` into `slot`, a victim chosen for a read
    /// ahead: a prompt's (`prompt_ahead`: promoted when a batch waits for
    /// it, not judged as a prefetch) or a decode's prefetch, counted.
    pub(super) fn start_ahead(&self, st: &mut State, slot: SlotId, ll: &LayerLayout, expert: u32, for_prompt: bool) -> Vec<Job> {
        let evicted = st.res.fill(slot, ExpertKey::new(ll.layer, expert));
        let jobs = self.start_load(st, slot, ll, expert, evicted, false);
        if for_prompt {
            st.slots[slot].prompt_ahead = true;
        } else {
            st.slots[slot].prefetched = true;
            st.counts.get_mut(&ll.layer).expect("layer counted").prefetched += 1;
        }
        jobs
    }

    pub(super) fn submit(&self, jobs: Vec<Job>, lane: Lane) {
        if jobs.is_empty() {
            return;
        }
        let n = jobs.len();
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        match lane {
            Lane::Demand => q.demand.extend(jobs),
            Lane::Spare => q.spare.extend(jobs),
        }
        drop(q);
        // One reader per job: waking all of them on a 2-core machine takes
        // the cores from ggml's threads for nothing.
        for _ in 0..n {
            self.queued.notify_one();
        }
    }

    /// Faults in the whole arena at once (`SDQ_POPULATE=1`), before the
    /// first token: on this project's VM, cold decode at an enforced 8 GiB
    /// ran 5.3 tok/s with the faults inside the reads and 8.1-9.0 with the
    /// arena faulted in first, which took 6-16 s. The budget plans the whole
    /// arena, so this holds nothing it did not grant.
    pub(super) fn populate(&self) {
        let started = Instant::now();
        if let Err(e) = self.arena.populate() {
            // Kernels before 5.14 lack MADV_POPULATE_WRITE: slots fault on first use.
            log::info!("arena not populated ahead of use: {e}");
            return;
        }
        log::info!("arena of {} populated in {:.1} s", crate::units::human(self.arena.len() as u64), started.elapsed().as_secs_f64());
    }

    /// The idle-priority populater: faults slots in, in the order free slots
    /// are taken (lowest first in each class, classes in turn), until the
    /// arena is done or the pager is dropped. This moves the faults off the
    /// miss path onto cores that compute leaves idle (waiting for reads, or
    /// between tokens). With a `window` (bytes per class), it stays no
    /// further than that ahead of each class's fill frontier, waiting for
    /// the arena to fill: the pages a run never fills are never faulted in,
    /// and faulting them does not compete with the prefill.
    pub(super) fn populate_idle(&self, window: Option<usize>) {
        if !arena::idle_priority() {
            log::debug!("populate thread: SCHED_IDLE refused; populating at normal priority");
        }
        let started = Instant::now();
        let classes = self.arena.classes();
        let ahead: Vec<usize> = classes.iter().map(|c| window.map_or(c.count, |w| (w / c.slot_bytes).max(1))).collect();
        // How far class c may be faulted in now.
        let target = |st: &State, c: usize| (st.filled[c] + ahead[c]).min(classes[c].count);
        let mut done = vec![0usize; classes.len()];
        loop {
            if self.queue.lock().unwrap_or_else(|p| p.into_inner()).closed {
                return;
            }
            // One slot of each class whose frontier is within reach, in turn.
            let targets: Vec<usize> = {
                let st = self.lock();
                (0..classes.len()).map(|c| target(&st, c)).collect()
            };
            if done.iter().zip(classes).all(|(&d, c)| d >= c.count) {
                break;
            }
            let mut progressed = false;
            for (c, class) in classes.iter().enumerate() {
                if done[c] >= targets[c] {
                    continue;
                }
                let slot = class.first + done[c];
                done[c] += 1;
                progressed = true;
                if self.lock().slots[slot].retired {
                    continue;
                }
                if let Err(e) = self.arena.populate_slot(slot) {
                    // Kernels before 5.14 lack MADV_POPULATE_WRITE: slots fault on first use.
                    log::info!("arena not populated ahead of use: {e}");
                    return;
                }
                // Retired meanwhile: the pages just faulted in go back too.
                let mut st = self.lock();
                if st.slots[slot].retired {
                    self.settle(&mut st, slot);
                }
            }
            if !progressed {
                // Caught up with the frontier: wait for the arena to fill.
                let st = self.lock();
                if (0..classes.len()).all(|c| done[c] >= target(&st, c)) {
                    let _ = self.changed.wait_timeout(st, std::time::Duration::from_millis(100));
                }
            }
        }
        log::info!("arena of {} populated in the background in {:.1} s", crate::units::human(self.arena.len() as u64), started.elapsed().as_secs_f64());
    }

    /// Moves the queued prefetch reads of `slot` ahead of every other read:
    /// a batch needs that expert now.
    pub(super) fn promote(&self, slot: SlotId) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let (mine, rest): (VecDeque<Job>, VecDeque<Job>) = std::mem::take(&mut q.spare).into_iter().partition(|j| j.slot == slot);
        q.spare = rest;
        for j in mine.into_iter().rev() {
            q.demand.push_front(j);
        }
    }

    /// Reads warm-start expert `key` into a free slot of its class, on this
    /// reader thread; nothing if it is held already or no slot is free.
    pub(super) fn warm_one(&self, key: ExpertKey) {
        let ll = &self.layout.layers[&key.layer];
        let jobs = {
            let mut st = self.lock();
            if st.res.slot_of(key).is_some() {
                return;
            }
            let Some(slot) = st.usable(&self.arena, ll.class).find(|&s| st.res.key(s).is_none() && st.slots[s].pins == 0) else { return };
            let evicted = st.res.fill(slot, key);
            let jobs = self.start_load(&mut st, slot, ll, key.expert, evicted, false);
            st.slots[slot].prefetched = true;
            st.counts.get_mut(&key.layer).expect("layer counted").preloaded += 1;
            st.warm_read += 1;
            jobs
        };
        for job in jobs {
            let result = self.read_part(&job);
            self.finish_part(&job, result);
        }
    }

    /// A reader thread: takes jobs until the pager is dropped.
    pub(super) fn read_jobs(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(j) = q.demand.pop_front() {
                        break (Some(j), None);
                    }
                    if q.closed {
                        return;
                    }
                    if let Some(j) = q.spare.pop_front() {
                        break (Some(j), None);
                    }
                    if q.warm_reading < WARM_READERS && !q.in_step {
                        if let Some(key) = q.warm.pop_front() {
                            q.warm_reading += 1;
                            break (None, Some(key));
                        }
                    }
                    q = self.queued.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            match job {
                (Some(job), _) => {
                    let result = self.read_part(&job);
                    self.finish_part(&job, result);
                }
                (None, Some(key)) => {
                    self.warm_one(key);
                    self.queue.lock().unwrap_or_else(|p| p.into_inner()).warm_reading -= 1;
                    // A reader that found WARM_READERS busy may take the next.
                    self.queued.notify_one();
                }
                (None, None) => unreachable!("a reader takes a job or a warm-start expert"),
            }
        }
    }

    pub(super) fn read_part(&self, job: &Job) -> Result<()> {
        let ll = &self.layout.layers[&job.layer];
        let span = &ll.parts[job.part];
        let (offset, head, len) = (span.file_offset(job.expert), span.head(job.expert), span.read_len(job.expert));
        // SAFETY: the slot is pinned by its load and unpublished (ready ==
        // false): no victim choice takes it and every acquirer of its key
        // waits; each part's region is given to exactly one job.
        let region = unsafe { self.arena.slot_range_mut(job.slot, span.slot_offset..span.slot_offset + len) };
        // A panic in the reading code (sdq's bug) is this read's error: the
        // slot is failed like any other, and the reader thread lives on.
        let read = match crate::engine::ffi::unwind::catch(|| match &span.direct {
            // The aligned superset: from the 4 KiB boundary below the range.
            Some(direct) => match self.reader.read_direct(direct, region, offset - head as u64, head + span.bytes) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // The file system took O_DIRECT at open but not for reads.
                    log::warn!("{}: direct read refused ({e}); reading through the page cache", span.path.display());
                    self.reader.read_exact_at(&span.file, &mut region[head..head + span.bytes], offset)
                }
                r => r,
            },
            None => self.reader.read_exact_at(&span.file, region, offset),
        }) {
            Ok(read) => read,
            Err(failure) => {
                return Err(Error::Internal(format!(
                    "reading {:?} of expert {} of layer {} (offset {offset}) from {}: {failure}",
                    span.part,
                    job.expert,
                    ll.layer,
                    span.path.display()
                )))
            }
        };
        // The stamp is checked after the read: bytes read from a file that
        // changed meanwhile are never published.
        read.and_then(|()| span.stamp.check(&span.file))
            .map_err(|e| Error::io(format!("reading {:?} of expert {} of layer {} (offset {offset}) from", span.part, job.expert, ll.layer), &span.path, e))?;
        // Stock's loader converts this weight into a repacked layout: so does
        // the reader, before the expert is published.
        if let WeightLayout::Repacked(r) = span.layout {
            let started = crate::engine::memory::budget::thread_cpu_ns();
            let converted = r.convert(&mut region[head..head + span.bytes]);
            self.converted.fetch_add(1, Ordering::Relaxed);
            self.convert_ns.fetch_add(crate::engine::memory::budget::thread_cpu_ns().saturating_sub(started), Ordering::Relaxed);
            if !converted {
                return Err(Error::model(format!(
                    "{}: ggml refused to convert {:?} of expert {} of layer {} to {}",
                    span.path.display(),
                    span.part,
                    job.expert,
                    ll.layer,
                    r.name()
                )));
            }
        }
        Ok(())
    }

    pub(super) fn finish_part(&self, job: &Job, result: Result<()>) {
        let mut st = self.lock();
        let key = ExpertKey::new(job.layer, job.expert);
        if let Some(id) = st.slots[job.slot].batch {
            let done = st.batches.get_mut(&id).map(|b| {
                b.1 -= 1;
                b.1 == 0
            });
            if done == Some(true) {
                let (bytes, _, started) = st.batches.remove(&id).expect("batch present");
                st.batch_totals.0 += 1;
                st.batch_totals.1 += bytes;
                st.batch_totals.2 += started.elapsed().as_nanos() as u64;
            }
        }
        if let Err(e) = result {
            // One failure per expert read, whichever of its parts failed first.
            if !st.slots[job.slot].failed {
                st.failures += 1;
                let n = st.failures;
                let bug = matches!(e, Error::Internal(_));
                st.errors.insert(key, super::ReadFailure { message: e.to_string(), number: n, bug });
            }
            st.slots[job.slot].failed = true;
        }
        let s = &mut st.slots[job.slot];
        s.parts_left -= 1;
        if s.parts_left > 0 {
            return;
        }
        let (failed, started) = (s.failed, s.started.take());
        if failed {
            st.res.clear(job.slot);
            st.slots[job.slot] = Slot { retired: st.slots[job.slot].retired, ..Slot::default() };
            self.settle(&mut st, job.slot);
        } else {
            let s = &mut st.slots[job.slot];
            s.ready = true;
            if !s.keep_pin {
                s.pins -= 1;
            }
            self.settle(&mut st, job.slot);
            let ll = &self.layout.layers[&job.layer];
            st.bytes_read += ll.expert_bytes as u64;
            st.device_bytes += ll.parts.iter().map(|p| p.read_len(job.expert) as u64).sum::<u64>();
            st.read_ns += started.map_or(0, |t| t.elapsed().as_nanos() as u64);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Gives a retired slot's memory back once nothing pins it: the expert
    /// it holds leaves the residency (a later use reads it again into a
    /// slot in use) and its pages go to the kernel. Nothing for other slots.
    pub(super) fn settle(&self, st: &mut State, slot: SlotId) {
        let s = st.slots[slot];
        if !s.retired || s.pins > 0 {
            return;
        }
        if let Some(old) = st.res.key(slot) {
            if s.prefetched {
                st.counts.get_mut(&old.layer).expect("layer counted").prefetch_wasted += 1;
            }
            st.res.clear(slot);
        }
        st.slots[slot] = Slot { retired: true, ..Slot::default() };
        // SAFETY: the slot is retired (no victim choice or free-slot search
        // takes it), unpinned (no reader, no load) and holds no expert (no
        // lookup finds it); the state lock is held, so none of that changes
        // before the pages are gone.
        if let Err(e) = unsafe { self.arena.discard(slot..slot + 1) } {
            log::warn!("could not give slot {slot}'s memory back: {e}");
        }
    }

    pub(super) fn release(&self, slot: SlotId) {
        let mut st = self.lock();
        let s = &mut st.slots[slot];
        assert!(s.pins > 0, "release of an unpinned slot {slot}");
        s.pins -= 1;
        let free = s.pins == 0;
        self.settle(&mut st, slot);
        let (demand, spare) = if free { self.refill(&mut st) } else { Default::default() };
        drop(st);
        self.submit(demand, Lane::Demand);
        self.submit(spare, Lane::Spare);
        if free {
            self.changed.notify_all();
        }
    }
}
