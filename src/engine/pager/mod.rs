//! The pager: `acquire(layer, expert)` returns the expert's bytes pinned in an
//! arena slot, reading them from the model file on a miss; dropping the pin
//! releases it. `prepare(layer, experts)` starts a batch's misses all at once,
//! as soon as the router has chosen, so they are read in parallel (a pool of
//! reader threads, one read per part) while resident experts are computed.
//! `prefetch(layer, experts)` reads experts a later layer is predicted to
//! need, at low priority: readers take those jobs only when no demand read
//! is waiting, and a batch that needs a queued prefetch promotes it.
//!
//! Invariants (checked by the tests and asserted where cheap):
//! - a key is in the residency only while its slot holds exactly that expert's bytes
//!   or is being filled with them (`ready == false`); readers wait for `ready`;
//! - a slot being filled is pinned by its loader, so it is never chosen as a
//!   victim, and nobody else reads or writes it;
//! - a failed read removes the key and frees the slot: stale bytes are never
//!   published; the acquire that started the read gets the error, and any
//!   other use of that expert reads it again;
//! - a retired slot (`set_slots`, memory pressure) is never given to an
//!   expert; once unpinned it holds none and its pages are the kernel's.
//!
//! Over 600 lines: the pager's state machine (acquire, prepare, release)
//! sits in one file so that its invariants read in one place; reads ahead
//! (`ahead`), the arena, the reader pool, the policy and residency are its
//! own modules beside it.

mod ahead;
pub mod arena;
mod counts;
pub mod freq_auto;
pub mod gate;
pub mod io;
pub mod layout;
pub mod policy;
mod policy_kind;
mod readers;
pub mod residency;
mod reuse;
mod routes;
mod warm;

pub use counts::{LayerCounts, PagerCounts, PagerTotals};
pub use policy_kind::PolicyKind;
use readers::{Lane, Queue, WARM_READERS};

use crate::engine::ffi::ggml::WeightLayout;
use crate::error::{Error, Result};
pub use arena::PageChoice;
use arena::{Arena, SlotId};
use layout::{LayerLayout, Layout, Part};
use residency::Residency;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// One routed expert of one layer: what the pager reads, holds and evicts.
/// Ordered by layer, then expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: u32,
    pub expert: u32,
}

impl ExpertKey {
    pub const fn new(layer: u32, expert: u32) -> ExpertKey {
        ExpertKey { layer, expert }
    }
}

/// `key`'s cell of a table kept per layer, per expert (layers and experts
/// are numbered from 0), the table grown with defaults to hold it.
fn expert_cell<T: Clone + Default>(table: &mut Vec<Vec<T>>, key: ExpertKey) -> &mut T {
    let (l, e) = (key.layer as usize, key.expert as usize);
    if table.len() <= l {
        table.resize(l + 1, Vec::new());
    }
    if table[l].len() <= e {
        table[l].resize(e + 1, T::default());
    }
    &mut table[l][e]
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    pins: u32,
    ready: bool,
    /// Parts still being read (while loading).
    parts_left: u32,
    /// A part failed to read (while loading).
    failed: bool,
    /// When the load was submitted.
    started: Option<Instant>,
    /// The `prepare` batch this load belongs to.
    batch: Option<u64>,
    /// The acquire that started the load takes over its pin when it is read.
    keep_pin: bool,
    /// Read by `prefetch` and not used by a batch since.
    prefetched: bool,
    /// Read ahead for a prompt (`read_ahead`: its routing or its union of
    /// predictions, nearly certain to be used) and not used since: a batch
    /// that waits for it moves its read ahead, but it is not a prefetch the
    /// gate judges decode predictions by.
    prompt_ahead: bool,
    /// Read by `prepare` for a batch that has not pinned it yet: another
    /// acquire evicts it only when nothing else is free, since the batch
    /// would then read it again.
    awaiting: bool,
    /// Beyond its class's slots in use (`Pager::set_slots`): never given to
    /// an expert; its pages go back to the kernel once it is unpinned.
    retired: bool,
}

struct State {
    slots: Vec<Slot>,
    /// Which expert each slot holds, and the eviction policy.
    res: Residency,
    counts: HashMap<u32, LayerCounts>,
    bytes_read: u64,
    /// Bytes asked of the disk: bytes_read plus direct I/O's alignment padding.
    device_bytes: u64,
    read_ns: u64,
    /// The error of each expert whose last read failed, numbered from
    /// `failures`: the acquire that started the read gets it (its batch
    /// stops); any other use of the expert reads it again.
    errors: HashMap<ExpertKey, ReadFailure>,
    /// Expert reads that failed so far.
    failures: u64,
    /// Batches of misses `prepare` submitted: (bytes, parts left, started), by id.
    batches: HashMap<u64, (u64, u32, Instant)>,
    next_batch: u64,
    /// Completed batches: count, bytes, and wall time from submission to the last byte.
    batch_totals: (u64, u64, u64),
    /// Experts a warm start has read (or is reading).
    warm_read: u64,
    /// Slots of each class in use: the first `in_use[c]` of class c; the
    /// rest are retired (memory given back under pressure).
    in_use: Vec<usize>,
    /// The fill frontier of each class: slots `first..first + filled[c]`
    /// have held an expert (free slots are taken lowest first, so the arena
    /// fills from the bottom of each class up). `Populate::Ahead` faults in
    /// a window beyond it.
    filled: Vec<usize>,
    /// Whether reading ahead pays, from the share of prefetches used.
    gate: gate::PrefetchGate,
    /// What a prompt group's ubatches still need, by layer (see
    /// `group_routes`); emptied when the group ends.
    group_routes: routes::GroupRoutes,
    /// A decode step's prediction of the next layer (`Pager::predicted`):
    /// that layer, and the predicted experts the arena did not hold then,
    /// which its next batch judges.
    prediction: Option<(u32, Vec<u32>)>,
    /// The misses of the batch `prepare` started that found no slot, in
    /// the order its threads take them: each is read as soon as a slot is
    /// released (`Shared::refill`), not when a thread comes to it.
    pending: VecDeque<ExpertKey>,
    /// Prompt reads ahead that found no spare slot: continued as slots are
    /// released, once `pending` is empty (see `ahead`).
    ahead_rest: Vec<ahead::AheadRest>,
}

/// A failed read of an expert, kept for the acquire that waits for it.
struct ReadFailure {
    message: String,
    /// Its number among the pager's failures.
    number: u64,
    /// The reading code panicked (see `readers::read_part`).
    bug: bool,
}

impl State {
    /// The slots of `class` that experts may take.
    fn usable(&self, arena: &Arena, class: usize) -> std::ops::Range<SlotId> {
        let first = arena.classes()[class].first;
        first..first + self.in_use[class]
    }

    /// The slot in `class` to read a batch's miss of `layer` into: one the
    /// batch is done with (unpinned, not awaited), preferably holding what
    /// no later ubatch of a prompt group routes to at this layer, which it
    /// would read again. (The policy alone evicts the first experts the
    /// batch is done with, which are often the ones it shares with the
    /// group's next ubatch.)
    fn demand_victim(&self, layer: u32, class: std::ops::Range<SlotId>) -> Option<SlotId> {
        self.spare_victim(layer, class.clone()).or_else(|| self.res.victim(layer, class, &|s| self.unclaimed(s)))
    }

    /// As `demand_victim`, but only a slot no later ubatch needs: what a
    /// miss read before the batch comes to it may take (`Shared::refill`).
    fn spare_victim(&self, layer: u32, class: std::ops::Range<SlotId>) -> Option<SlotId> {
        let needed = |s: SlotId| self.res.key(s).is_some_and(|k| self.group_routes.needed_later(k.layer, k.expert));
        self.res.victim(layer, class, &|s| self.unclaimed(s) && !needed(s))
    }

    /// Neither pinned (computed with, or being read) nor awaited by the
    /// batch computing now.
    fn unclaimed(&self, s: SlotId) -> bool {
        self.slots[s].pins == 0 && !self.slots[s].awaiting
    }
}

/// When the arena's memory is faulted in (`SDQ_POPULATE`). A fresh slot's
/// page faults otherwise happen inside the read that first fills it, on
/// the miss path; on a VM that backs guest memory lazily, they cost about as
/// much as the read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Populate {
    /// On first use, inside the read (`0`).
    Off,
    /// By a background thread at idle priority, slot by slot in the order
    /// free slots are filled, on cores compute leaves idle (`idle`).
    Idle,
    /// All of it before the first token (`1`).
    Now,
    /// By a background thread at idle priority, no further than a window
    /// ahead of the slots filled so far (`ahead`): a fresh slot is faulted
    /// in before its first read, and memory the run never fills is not
    /// (the default: populating all of an 8 GiB budget's arena competed
    /// with the prefill for the cores and made the first token later).
    #[default]
    Ahead,
}

impl Populate {
    pub fn parse(v: &str) -> Option<Populate> {
        match v.trim() {
            "0" | "off" | "false" => Some(Populate::Off),
            "1" | "on" | "true" | "now" => Some(Populate::Now),
            "idle" => Some(Populate::Idle),
            "ahead" => Some(Populate::Ahead),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Populate::Off => "0",
            Populate::Now => "1",
            Populate::Idle => "idle",
            Populate::Ahead => "ahead",
        }
    }
}

/// How far `Populate::Ahead` faults in beyond each class's filled slots.
/// Decode fills about 40-60 MiB a token on the 35B-A3B, so this is several
/// tokens' fills; a prefill fills faster than any populater keeps up with.
pub const POPULATE_AHEAD_BYTES: usize = 256 << 20;

/// Readers in the pool when `SDQ_READERS` does not say.
pub const DEFAULT_READERS: usize = 8;

/// What an acquire counts for the layer's figures (`prepare` has counted
/// the use itself as a hit or a miss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    /// A read is a reread: the expert was there at `prepare`, or was read by
    /// it, and has been evicted since.
    Later,
    /// Counted already (`prepare` counted the miss and left the read to this acquire).
    Nothing,
}

struct Shared {
    layout: Layout,
    arena: Arena,
    reader: io::ExpertReader,
    state: Mutex<State>,
    changed: Condvar,
    queue: Mutex<Queue>,
    queued: Condvar,
    /// Parts converted into a repacked layout, and the time it took.
    converted: AtomicU64,
    convert_ns: AtomicU64,
}

pub struct Pager {
    shared: Arc<Shared>,
    /// Its threads, joined when it is dropped or retired.
    readers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// An expert's bytes, pinned in its slot until dropped.
pub struct PinnedExpert<'a> {
    pager: &'a Pager,
    slot: SlotId,
    expert: u32,
    layer: &'a LayerLayout,
}

impl PinnedExpert<'_> {
    /// The bytes of one part (gate, up, gate_up or down) of this expert.
    pub fn part(&self, part: Part) -> &[u8] {
        let span = self.layer.part(part).unwrap_or_else(|| panic!("layer {} has no {part:?} part", self.layer.layer));
        // SAFETY: the slot is pinned and published (ready), so no one writes
        // it until this pin is dropped, which outlives the returned slice.
        let bytes = unsafe { self.pager.shared.arena.slot(self.slot) };
        let start = span.slot_offset + span.head(self.expert);
        &bytes[start..start + span.bytes]
    }
}

impl Drop for PinnedExpert<'_> {
    fn drop(&mut self) {
        self.pager.shared.release(self.slot);
    }
}

impl Pager {
    /// A pager over `layout` with `slots[i]` slots for class i, reading
    /// with `readers` threads, its arena faulted in as `populate` says,
    /// evicting by `policy` for a model of `top_k` experts a token.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: Layout,
        slots: &[usize],
        reader: io::ExpertReader,
        readers: usize,
        populate: Populate,
        policy: PolicyKind,
        top_k: usize,
        pages: PageChoice,
    ) -> Result<Pager> {
        assert_eq!(slots.len(), layout.class_bytes.len(), "one slot count per class");
        let classes: Vec<(usize, usize)> = layout.class_bytes.iter().copied().zip(slots.iter().copied()).collect();
        let arena = Arena::with_pages(&classes, pages)
            .map_err(|e| Error::resource(format!("cannot map an expert arena of {} slots: {e}", slots.iter().sum::<usize>())))?;
        let n = arena.n_slots();
        let state = State {
            slots: vec![Slot::default(); n],
            res: Residency::new(n, policy.build(&policy::Plan::new(&layout, arena.classes(), top_k))),
            counts: layout.layers.keys().map(|&l| (l, LayerCounts::default())).collect(),
            bytes_read: 0,
            device_bytes: 0,
            read_ns: 0,
            errors: HashMap::new(),
            failures: 0,
            batches: HashMap::new(),
            next_batch: 0,
            batch_totals: (0, 0, 0),
            warm_read: 0,
            in_use: slots.to_vec(),
            filled: vec![0; slots.len()],
            gate: gate::PrefetchGate::default(),
            group_routes: routes::GroupRoutes::default(),
            prediction: None,
            pending: VecDeque::new(),
            ahead_rest: Vec::new(),
        };
        let shared = Arc::new(Shared {
            layout,
            arena,
            reader,
            state: Mutex::new(state),
            changed: Condvar::new(),
            queue: Mutex::new(Queue::default()),
            queued: Condvar::new(),
            converted: AtomicU64::new(0),
            convert_ns: AtomicU64::new(0),
        });
        let mut readers = (0..readers.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("sdq-reader-{i}"))
                    .spawn(move || shared.read_jobs())
                    .map_err(|e| Error::resource(format!("cannot start reader thread {i}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        match populate {
            Populate::Off => {}
            Populate::Now => shared.populate(),
            Populate::Idle | Populate::Ahead => {
                let s = Arc::clone(&shared);
                let window = match populate {
                    Populate::Ahead => Some(POPULATE_AHEAD_BYTES),
                    _ => None,
                };
                let t = std::thread::Builder::new()
                    .name("sdq-populate".into())
                    .spawn(move || s.populate_idle(window))
                    .map_err(|e| Error::resource(format!("cannot start the populate thread: {e}")))?;
                readers.push(t);
            }
        }
        Ok(Pager { shared, readers: Mutex::new(readers) })
    }

    /// The pages behind the arena.
    pub fn arena_backing(&self) -> &arena::Backing {
        self.shared.arena.backing()
    }

    /// Why the arena has other pages than it was asked for.
    pub fn arena_fallback(&self) -> Option<&str> {
        self.shared.arena.fallback()
    }

    /// What of the arena is backed by memory now, and in huge pages, the
    /// latter as read at most `huge_within` ago (None if unreadable).
    pub fn arena_pages_held(&self, huge_within: std::time::Duration) -> Option<arena::PagesHeld> {
        self.shared.arena.pages_held(huge_within)
    }

    /// Bytes of the slots that have held an expert so far: each class's
    /// slots up to its fill frontier.
    pub fn arena_filled_bytes(&self) -> u64 {
        let st = self.shared.lock();
        self.shared.arena.classes().iter().zip(&st.filled).map(|(c, &n)| (n * c.slot_bytes) as u64).sum()
    }

    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// True if every class has a slot for each expert of its layers.
    pub fn holds_every_expert(&self) -> bool {
        self.every_class_holds(|layers| layers)
    }

    /// True if every class has a slot for each expert of one of its layers:
    /// a prompt's ubatches computed layer by layer read each expert once.
    pub fn holds_a_layer(&self) -> bool {
        self.every_class_holds(|layers| layers.min(1))
    }

    /// True if every class has slots for all experts of `held(its layers)`
    /// layers.
    fn every_class_holds(&self, held: impl Fn(usize) -> usize) -> bool {
        let layers = self.shared.layout.layers_per_class();
        let n_expert = self.shared.layout.layers.values().map(|l| l.n_expert as usize).max().unwrap_or(0);
        self.shared.arena.classes().iter().zip(layers).all(|(c, l)| c.count >= held(l) * n_expert)
    }

    /// How many tokens' experts the arena holds at `top_k` a layer: the
    /// tightest slot class's slots over its layers' top-k.
    pub fn token_cycles(&self, top_k: usize) -> f64 {
        let layers = self.shared.layout.layers_per_class();
        let classes = self.shared.arena.classes().iter().zip(layers).filter(|(_, l)| *l > 0);
        classes.map(|(c, l)| c.count as f64 / (l * top_k.max(1)) as f64).fold(f64::INFINITY, f64::min)
    }

    pub fn arena(&self) -> &Arena {
        &self.shared.arena
    }

    fn layer(&self, layer: u32, expert: u32) -> Result<&LayerLayout> {
        let ll = self.shared.layout.layers.get(&layer).ok_or_else(|| Error::invalid(format!("layer {layer} has no paged experts")))?;
        if expert >= ll.n_expert {
            return Err(Error::invalid(format!("expert {expert} of layer {layer} out of range ({} experts)", ll.n_expert)));
        }
        Ok(ll)
    }

    /// Starts a batch's use of `experts` of `layer` (the router's choice):
    /// counts each as a hit or a miss, and submits every miss to the readers
    /// at once, into slots that hold none of the batch's experts. Returns the
    /// misses it found no slot for (counted here, so their acquire counts
    /// `Count::Nothing`): each is read as soon as a slot is released, or by
    /// its acquire if that comes first. `whole_group`: the batch is a
    /// prompt group's every ubatch at this layer (their expert ops shared),
    /// so none of the group needs the layer's experts after it.
    pub fn prepare(&self, layer: u32, experts: &[u32], whole_group: bool) -> Result<Vec<u32>> {
        let sh = &*self.shared;
        for &e in experts {
            self.layer(layer, e)?;
        }
        let ll = &sh.layout.layers[&layer];
        let mut jobs = Vec::new();
        let mut st = sh.lock();
        // One batch's experts are awaited at a time: what an earlier batch
        // left (it failed before pinning them all) is nobody's now, and
        // neither are its misses still to read, nor reads ahead of a layer
        // every ubatch is past.
        for s in &mut st.slots {
            s.awaiting = false;
        }
        st.pending.clear();
        st.ahead_rest.retain(|r| r.layer > layer);
        if whole_group {
            st.group_routes.all_start(layer);
        } else {
            st.group_routes.batch_starts(layer);
        }
        let class = st.usable(&sh.arena, ll.class);
        let admission = {
            let State { slots, res, .. } = &mut *st;
            // Slots still pinned belong to reads in flight (prefetches).
            res.admit(layer, class, experts, &|s| slots[s].pins == 0)
        };
        let c = st.counts.get_mut(&layer).expect("layer counted");
        c.hits += admission.hits.len() as u64;
        c.misses += (admission.fills.len() + admission.deferred.len()) as u64;
        if let Some((_, predicted)) = st.prediction.take_if(|(l, _)| *l == layer) {
            let held = predicted.iter().filter(|e| experts.contains(e)).count() as u64;
            let c = st.counts.get_mut(&layer).expect("layer counted");
            c.prediction_held += held;
            c.prediction_missed += predicted.len() as u64 - held;
        }
        for &(_, slot) in &admission.hits {
            let s = &mut st.slots[slot];
            // The batch is still to use it: a read for one of its misses
            // takes another slot first.
            s.awaiting = true;
            if std::mem::take(&mut s.prompt_ahead) && !s.ready {
                sh.promote(slot);
            }
            let (prefetched, ready) = (std::mem::take(&mut s.prefetched), s.ready);
            if prefetched {
                let c = st.counts.get_mut(&layer).expect("layer counted");
                c.prefetch_used += 1;
                if !ready {
                    c.prefetch_late += 1;
                    sh.promote(slot);
                }
            }
        }
        for f in &admission.fills {
            jobs.extend(sh.start_load(&mut st, f.slot, ll, f.expert, f.evicted, false));
            st.slots[f.slot].awaiting = true;
        }
        if !jobs.is_empty() {
            let id = st.next_batch;
            st.next_batch += 1;
            for j in &jobs {
                st.slots[j.slot].batch = Some(id);
            }
            let bytes = (jobs.len() / ll.parts.len()) as u64 * ll.expert_bytes as u64;
            st.batches.insert(id, (bytes, jobs.len() as u32, Instant::now()));
        }
        st.pending.extend(admission.deferred.iter().map(|&e| ExpertKey::new(layer, e)));
        drop(st);
        sh.submit(jobs, Lane::Demand);
        Ok(admission.deferred)
    }

    /// Whether this layer's prefetch should run by default: while most
    /// predicted experts are used (see [`gate`]).
    pub fn prefetch_pays(&self) -> bool {
        let mut st = self.shared.lock();
        let (judged, held) = st.counts.values().fold((0, 0), |(j, h), c| (j + c.prediction_held + c.prediction_missed, h + c.prediction_held));
        st.gate.admit(judged, held)
    }

    /// The first of `candidates` (index, expert) whose expert of `layer` is
    /// in a slot and fully read.
    pub fn first_ready(&self, layer: u32, candidates: impl IntoIterator<Item = (usize, u32)>) -> Option<usize> {
        let st = self.shared.lock();
        candidates.into_iter().find(|&(_, e)| st.res.slot_of(ExpertKey::new(layer, e)).is_some_and(|s| st.slots[s].ready)).map(|(i, _)| i)
    }

    /// Pins expert `expert` of `layer`, reading it into a slot on a miss
    /// (or waiting for a read in flight).
    pub fn acquire(&self, layer: u32, expert: u32, count: Count) -> Result<PinnedExpert<'_>> {
        let sh = &*self.shared;
        let ll = self.layer(layer, expert)?;
        let key = ExpertKey::new(layer, expert);
        let mut st = sh.lock();
        // Failures numbered up to here happened before this acquire.
        let seen = st.failures;
        // Read here or found: not a pending miss any more (a later refill
        // would read it again once the batch is done with it).
        if let Some(i) = st.pending.iter().position(|&k| k == key) {
            st.pending.remove(i);
        }
        loop {
            // A read this acquire did not start (an earlier use's, a
            // prefetch, a preload, another thread's) failed: read it again
            // here. Only the failure of this acquire's own read is its answer.
            // A read that panicked (sdq's bug, not the disk's) is not tried
            // again: every batch that meets it fails, once.
            if let Some(ReadFailure { message, bug: true, .. }) = st.errors.remove(&key) {
                return Err(Error::Internal(message));
            }
            if let Some(slot) = st.res.slot_of(key) {
                if st.slots[slot].ready {
                    st.slots[slot].pins += 1;
                    st.slots[slot].awaiting = false;
                    return Ok(PinnedExpert { pager: self, slot, expert, layer: ll });
                }
                // Being read (by the readers, for this or another thread): wait.
                if st.slots[slot].prefetched || st.slots[slot].prompt_ahead {
                    sh.promote(slot);
                }
                st = sh.wait_for_read(st, layer);
                continue;
            }
            // The slots in use may change while this waits (`set_slots`).
            let class = st.usable(&sh.arena, ll.class);
            // A slot a batch is still waiting to use goes last: evicting it
            // means reading it again (a reread) within the same batch.
            let slots = &st.slots;
            let victim = st.demand_victim(layer, class.clone()).or_else(|| st.res.victim(layer, class.clone(), &|s| slots[s].pins == 0));
            match victim {
                Some(victim) => {
                    if count == Count::Later {
                        st.counts.get_mut(&layer).expect("layer counted").rereads += 1;
                    }
                    let evicted = st.res.fill(victim, key);
                    st.res.used(victim);
                    let jobs = sh.start_load(&mut st, victim, ll, expert, evicted, true);
                    drop(st);
                    sh.submit(jobs, Lane::Demand);
                    st = sh.lock();
                    loop {
                        if let Some(f) = st.errors.get(&key) {
                            if f.number > seen {
                                return Err(if f.bug { Error::Internal(f.message.clone()) } else { Error::Read(f.message.clone()) });
                            }
                        }
                        if st.slots[victim].ready && st.res.key(victim) == Some(key) {
                            // The load's pin is now this acquire's.
                            return Ok(PinnedExpert { pager: self, slot: victim, expert, layer: ll });
                        }
                        st = sh.wait_for_read(st, layer);
                    }
                }
                // Every slot of the class is pinned by another thread's
                // expert; each is released when that expert is computed.
                None => st = sh.wait_for_read(st, layer),
            }
        }
    }

    /// Sets how many slots of each class experts may use: at most what the
    /// arena was made with, at least one layer's top-k (`min`). Slots past
    /// the new count are retired: each gives its memory back to the kernel
    /// at once, or when its last pin is dropped (an expert being computed or
    /// read is never taken away); its expert is read again on its next use.
    /// Slots brought back into use start empty. Returns the slot bytes in use.
    pub fn set_slots(&self, counts: &[usize], min: usize) -> u64 {
        let sh = &*self.shared;
        let mut st = sh.lock();
        for (c, class) in sh.arena.classes().iter().enumerate() {
            let want = counts.get(c).copied().unwrap_or(class.count).clamp(min.min(class.count), class.count);
            let had = st.in_use[c];
            st.in_use[c] = want;
            for slot in class.first + want.min(had)..class.first + want.max(had) {
                st.slots[slot].retired = want < had;
                sh.settle(&mut st, slot);
            }
            if want > had {
                if let Err(e) = sh.arena.restore(class.first + had..class.first + want) {
                    log::warn!("slots {}..{} brought back on small pages: {e}", class.first + had, class.first + want);
                }
            }
        }
        let bytes = Self::bytes_in_use(&sh.arena, &st.in_use);
        drop(st);
        sh.changed.notify_all();
        bytes
    }

    /// Bytes of the slots experts may use (see `set_slots`).
    pub fn arena_bytes_in_use(&self) -> u64 {
        Self::bytes_in_use(&self.shared.arena, &self.shared.lock().in_use)
    }

    /// Slots of each class experts may use (see `set_slots`).
    pub fn slots_in_use(&self) -> Vec<usize> {
        self.shared.lock().in_use.clone()
    }

    fn bytes_in_use(arena: &Arena, in_use: &[usize]) -> u64 {
        arena.classes().iter().zip(in_use).map(|(c, &n)| (c.slot_bytes * n) as u64).sum()
    }

    /// Expert bytes read, hits, misses and prefetched hits so far (cheaper than `counts`).
    pub fn totals(&self) -> PagerTotals {
        let st = self.shared.lock();
        let (hits, misses, prefetch_used, waited_us) =
            st.counts.values().fold((0, 0, 0, 0), |(h, m, p, w), c| (h + c.hits, m + c.misses, p + c.prefetch_used, w + c.waited_us));
        PagerTotals { bytes_read: st.bytes_read, hits, misses, prefetch_used, waited_us }
    }

    /// Counts so far.
    pub fn counts(&self) -> PagerCounts {
        let st = self.shared.lock();
        let mut per_layer: Vec<(u32, LayerCounts)> = st.counts.iter().map(|(&l, &c)| (l, c)).collect();
        per_layer.sort_by_key(|p| p.0);
        PagerCounts {
            per_layer,
            bytes_read: st.bytes_read,
            device_bytes: st.device_bytes,
            read_seconds: st.read_ns as f64 / 1e9,
            reads: self.shared.reader.reads(),
            read_retries: self.shared.reader.retried(),
            read_failures: st.failures,
            converted: self.shared.converted.load(Ordering::Relaxed),
            convert_seconds: self.shared.convert_ns.load(Ordering::Relaxed) as f64 / 1e9,
            miss_batches: st.batch_totals.0,
            miss_batch_bytes: st.batch_totals.1,
            miss_batch_seconds: st.batch_totals.2 as f64 / 1e9,
            warm_read: st.warm_read,
            warm_pending: {
                let q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
                (q.warm.len() + q.warm_reading) as u64
            },
        }
    }
}

impl Pager {
    /// Stops the reader threads: queued reads are dropped, a read in
    /// progress finishes first.
    fn stop_readers(&self) {
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.closed = true;
            q.demand.clear();
            q.spare.clear();
            q.warm.clear();
        }
        self.shared.queued.notify_all();
        // The populater may be waiting for the arena to fill.
        self.shared.changed.notify_all();
        let readers = std::mem::take(&mut *self.readers.lock().unwrap_or_else(|p| p.into_inner()));
        for r in readers {
            let _ = r.join();
        }
    }

    /// The models this pager served are gone (a host program freed the
    /// last of them): its threads stop and its arena's memory goes back to
    /// the kernel. Returns the bytes the arena held. The pager is not used
    /// again: the next model gets a pager of its own.
    pub fn retire(&self) -> u64 {
        self.stop_readers();
        let held = self.shared.arena.resident_bytes().unwrap_or(0);
        let st = self.shared.lock();
        for class in self.shared.arena.classes() {
            // SAFETY: no model is left, so no graph computes with these
            // slots, and the readers (the only other writers) have been
            // joined; the state lock keeps any straggler out meanwhile.
            if let Err(e) = unsafe { self.shared.arena.discard(class.slots()) } {
                log::warn!("cannot give back the arena's slots of {} bytes: {e}", class.slot_bytes);
            }
        }
        drop(st);
        held
    }
}

impl Drop for Pager {
    fn drop(&mut self) {
        self.stop_readers();
    }
}
