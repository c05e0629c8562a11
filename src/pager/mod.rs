//! The pager: `acquire(layer, expert)` returns the expert's bytes pinned in an
//! arena slot, reading them from the model file on a miss; dropping the pin
//! releases it.
//!
//! Invariants (checked by the tests and asserted where cheap):
//! - a key is in `table` only while its slot holds exactly that expert's bytes
//!   or is being filled with them (`ready == false`); readers wait for `ready`;
//! - a slot being filled is pinned by its loader, so it is never chosen as a
//!   victim, and nobody else reads or writes it;
//! - a failed read removes the key and frees the slot: stale bytes are never
//!   published, and a later acquire reads again.

pub mod arena;
pub mod io;
pub mod layout;
pub mod policy;

use crate::error::{Error, Result};
use arena::{Arena, SlotId};
use layout::{LayerLayout, Layout, Part};
use policy::Lru;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// (layer, expert)
pub type ExpertKey = (u32, u32);

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    key: Option<ExpertKey>,
    pins: u32,
    ready: bool,
}

/// Counts of one layer. A *use* is one expert needed by one batch: its first
/// acquire (by the batch's first matmul of the expert) is a hit or a miss.
/// Later matmuls of the same use normally hit; if the expert was evicted in
/// between (a batch touching more experts than the arena holds), the read
/// again is a *reread*.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerCounts {
    pub hits: u64,
    pub misses: u64,
    pub rereads: u64,
}

struct State {
    slots: Vec<Slot>,
    table: HashMap<ExpertKey, SlotId>,
    lru: Lru,
    counts: HashMap<u32, LayerCounts>,
    bytes_read: u64,
    read_ns: u64,
}

/// Figures the pager has gathered so far.
#[derive(Clone, Debug, Default)]
pub struct PagerCounts {
    pub per_layer: Vec<(u32, LayerCounts)>,
    pub bytes_read: u64,
    pub read_seconds: f64,
    pub reads: u64,
}

pub struct Pager {
    layout: Layout,
    arena: Arena,
    reader: io::ExpertReader,
    state: Mutex<State>,
    changed: Condvar,
}

/// An expert's bytes, pinned in its slot until dropped.
pub struct PinnedExpert<'a> {
    pager: &'a Pager,
    slot: SlotId,
    layer: &'a LayerLayout,
}

impl PinnedExpert<'_> {
    /// The bytes of one part (gate, up, gate_up or down) of this expert.
    pub fn part(&self, part: Part) -> &[u8] {
        let span = self.layer.part(part).unwrap_or_else(|| panic!("layer {} has no {part:?} part", self.layer.layer));
        // SAFETY: the slot is pinned and published (ready), so no one writes
        // it until this pin is dropped, which outlives the returned slice.
        let bytes = unsafe { self.pager.arena.slot(self.slot) };
        &bytes[span.slot_offset..span.slot_offset + span.bytes]
    }
}

impl Drop for PinnedExpert<'_> {
    fn drop(&mut self) {
        self.pager.release(self.slot);
    }
}

impl Pager {
    /// A pager over `layout` with `slots[i]` slots for class i.
    pub fn new(layout: Layout, slots: &[usize], reader: io::ExpertReader) -> Result<Pager> {
        assert_eq!(slots.len(), layout.class_bytes.len(), "one slot count per class");
        let classes: Vec<(usize, usize)> = layout.class_bytes.iter().copied().zip(slots.iter().copied()).collect();
        let arena = Arena::new(&classes)
            .map_err(|e| Error::invalid(format!("cannot map an expert arena of {} slots: {e}", slots.iter().sum::<usize>())))?;
        let n = arena.n_slots();
        let state = State {
            slots: vec![Slot::default(); n],
            table: HashMap::new(),
            lru: Lru::new(n),
            counts: layout.layers.keys().map(|&l| (l, LayerCounts::default())).collect(),
            bytes_read: 0,
            read_ns: 0,
        };
        Ok(Pager { layout, arena, reader, state: Mutex::new(state), changed: Condvar::new() })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock aborts the process (panic = abort),
        // so a poisoned lock cannot be observed; recover the guard regardless.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pins expert `expert` of `layer`, reading it into a slot on a miss.
    /// `first` marks the first acquire of a use (it is counted as a hit or a miss).
    pub fn acquire(&self, layer: u32, expert: u32, first: bool) -> Result<PinnedExpert<'_>> {
        let ll = self
            .layout
            .layers
            .get(&layer)
            .ok_or_else(|| Error::invalid(format!("layer {layer} has no paged experts")))?;
        if expert >= ll.n_expert {
            return Err(Error::invalid(format!("expert {expert} of layer {layer} out of range ({} experts)", ll.n_expert)));
        }
        let key = (layer, expert);
        let class = self.arena.classes()[ll.class].slots();
        let mut st = self.lock();
        let slot = loop {
            if let Some(&slot) = st.table.get(&key) {
                if st.slots[slot].ready {
                    st.slots[slot].pins += 1;
                    st.lru.touch(slot);
                    if first {
                        st.counts.get_mut(&layer).expect("layer counted").hits += 1;
                    }
                    return Ok(PinnedExpert { pager: self, slot, layer: ll });
                }
                // Another thread is reading this expert: wait for it.
                st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            let slots = &st.slots;
            match st.lru.victim(class.clone(), |s| slots[s].pins == 0) {
                Some(victim) => break victim,
                // Every slot of the class is pinned by another thread's
                // expert; each is released when that expert is computed.
                None => st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        };
        if let Some(old) = st.slots[slot].key.take() {
            st.table.remove(&old);
        }
        st.slots[slot] = Slot { key: Some(key), pins: 1, ready: false };
        st.table.insert(key, slot);
        let counts = st.counts.get_mut(&layer).expect("layer counted");
        if first {
            counts.misses += 1;
        } else {
            counts.rereads += 1;
        }
        drop(st);

        let started = Instant::now();
        let result = self.load(slot, ll, expert);
        let elapsed = started.elapsed().as_nanos() as u64;

        let mut st = self.lock();
        match result {
            Ok(()) => {
                st.slots[slot].ready = true;
                st.lru.touch(slot);
                st.bytes_read += ll.expert_bytes as u64;
                st.read_ns += elapsed;
                drop(st);
                self.changed.notify_all();
                Ok(PinnedExpert { pager: self, slot, layer: ll })
            }
            Err(e) => {
                st.table.remove(&key);
                st.slots[slot] = Slot::default();
                st.lru.forget(slot);
                drop(st);
                self.changed.notify_all();
                Err(e)
            }
        }
    }

    /// Reads every part of `expert` into `slot`, the parts concurrently.
    fn load(&self, slot: SlotId, ll: &LayerLayout, expert: u32) -> Result<()> {
        // SAFETY: the slot is pinned by this thread and unpublished (ready ==
        // false): no victim choice takes it and every other acquirer of this
        // key waits, so this is the only reference to its bytes.
        let mut rest = unsafe { self.arena.slot_mut(slot) };
        let mut chunks = Vec::with_capacity(ll.parts.len());
        for span in &ll.parts {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(span.bytes);
            chunks.push((span, head));
            rest = tail;
        }
        let read = |span: &layout::PartSpan, buf: &mut [u8]| -> Result<()> {
            let offset = span.offset + expert as u64 * span.bytes as u64;
            // The stamp is checked after the read: bytes read from a file that
            // changed meanwhile are never published.
            self.reader.read_exact_at(&span.file, buf, offset).and_then(|()| span.stamp.check(&span.file)).map_err(|e| {
                Error::io(format!("reading {:?} of expert {expert} of layer {} (offset {offset}) from", span.part, ll.layer), &span.path, e)
            })
        };
        let (first, others) = chunks.split_first_mut().expect("an expert has parts");
        std::thread::scope(|s| {
            let handles: Vec<_> = others.iter_mut().map(|(span, buf)| s.spawn(move || read(span, buf))).collect();
            let mut result = read(first.0, first.1);
            for h in handles {
                let r = h.join().expect("reader thread");
                result = result.and(r);
            }
            result
        })
    }

    fn release(&self, slot: SlotId) {
        let mut st = self.lock();
        let s = &mut st.slots[slot];
        assert!(s.pins > 0, "release of an unpinned slot {slot}");
        s.pins -= 1;
        let free = s.pins == 0;
        drop(st);
        if free {
            self.changed.notify_all();
        }
    }

    /// Counts so far.
    pub fn counts(&self) -> PagerCounts {
        let st = self.lock();
        let mut per_layer: Vec<(u32, LayerCounts)> = st.counts.iter().map(|(&l, &c)| (l, c)).collect();
        per_layer.sort_by_key(|p| p.0);
        PagerCounts { per_layer, bytes_read: st.bytes_read, read_seconds: st.read_ns as f64 / 1e9, reads: self.reader.reads() }
    }
}
