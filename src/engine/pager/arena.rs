//! The arena: one anonymous mapping carved into slot classes, each class a run
//! of equal slots sized for one expert (gate + up + down) of some layers. All
//! raw-pointer access to slot bytes lives here.

use std::io;
use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Slots start on page boundaries (room for O_DIRECT reads later, and an
/// expert never shares a page with another).
pub const SLOT_ALIGN: usize = 4096;

/// Bytes a slot for an expert of `expert_bytes` occupies (rounded up to SLOT_ALIGN).
pub fn slot_bytes(expert_bytes: usize) -> usize {
    expert_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

/// A slot's index in the arena (slots of all classes are numbered together).
pub type SlotId = usize;

/// A run of equal slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotClass {
    /// Bytes of one expert of this class (gate + up + down).
    pub expert_bytes: usize,
    /// Bytes a slot occupies (expert_bytes rounded up to SLOT_ALIGN).
    pub slot_bytes: usize,
    /// Slot ids first..first+count belong to this class.
    pub first: SlotId,
    pub count: usize,
    /// Byte offset of the class's first slot in the mapping.
    offset: usize,
}

impl SlotClass {
    pub fn slots(&self) -> std::ops::Range<SlotId> {
        self.first..self.first + self.count
    }

    /// Lays out `counts[i]` slots for experts of `expert_bytes[i]` bytes, one
    /// class after another; returns the classes and the bytes they span.
    pub fn tile(classes: &[(usize, usize)]) -> io::Result<(Vec<SlotClass>, usize)> {
        let mut out = Vec::with_capacity(classes.len());
        let (mut offset, mut first) = (0usize, 0usize);
        for &(expert_bytes, count) in classes {
            let slot_bytes = slot_bytes(expert_bytes);
            out.push(SlotClass { expert_bytes, slot_bytes, first, count, offset });
            offset = slot_bytes.checked_mul(count).and_then(|b| b.checked_add(offset)).ok_or_else(|| io::Error::other("arena size overflows"))?;
            first += count;
        }
        Ok((out, offset))
    }
}

/// The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Which pages the arena asks for (`SDQ_HUGEPAGES`).
///
/// Transparent huge pages are the default: a 6 GiB arena takes 3,000
/// faults instead of 1.5 million, and the expert matmuls walk fewer TLB
/// entries. With the arena populated just ahead of its fills
/// (`Populate::Ahead`), they prefill and decode at least as fast as 4 KiB
/// pages at every budget measured (docs/BENCHMARKS.md, issue 20).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PageChoice {
    /// Transparent huge pages where the system offers them (`auto`, the default).
    #[default]
    Auto,
    /// 4 KiB pages only (`0`).
    Small,
    /// Explicit 2 MiB huge pages from the system's reserved pool
    /// (`hugetlb`; `vm.nr_hugepages`), falling back to `Auto` where the pool
    /// cannot hold the arena.
    Hugetlb,
}

impl PageChoice {
    pub fn parse(v: &str) -> Option<PageChoice> {
        match v.trim() {
            "auto" | "1" | "on" | "thp" => Some(PageChoice::Auto),
            "0" | "off" | "4k" => Some(PageChoice::Small),
            "hugetlb" => Some(PageChoice::Hugetlb),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PageChoice::Auto => "auto",
            PageChoice::Small => "0",
            PageChoice::Hugetlb => "hugetlb",
        }
    }
}

/// The pages behind the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// 2 MiB transparent huge pages, asked for with `MADV_HUGEPAGE` (the
    /// kernel still gives 4 KiB pages where it finds no free 2 MiB).
    TransparentHuge,
    /// 2 MiB pages from the reserved hugetlb pool (`MAP_HUGETLB`): all of
    /// them at once, never 4 KiB. They do not show in RssAnon, so the
    /// budget's measure adds `HugetlbPages` (see `budget::ProcMemory`).
    ExplicitHuge,
    /// 4 KiB pages.
    Small,
}

impl Backing {
    /// As the stats file names it.
    pub fn name(&self) -> &'static str {
        match self {
            Backing::TransparentHuge => "2 MiB transparent huge pages",
            Backing::ExplicitHuge => "2 MiB hugetlb pages",
            Backing::Small => "4 KiB pages",
        }
    }
}

/// The system's transparent huge page mode (`always`, `madvise` or
/// `never`), from sysfs; None where the kernel has none.
pub fn thp_mode() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

/// The pages an arena asks for with `choice` on this system, and why it
/// gets less than `choice` names (None: what was asked for).
pub fn backing_for(choice: PageChoice) -> (Backing, Option<String>) {
    match (choice, thp_mode().as_deref()) {
        (PageChoice::Hugetlb, _) => (Backing::ExplicitHuge, None),
        (PageChoice::Small, _) => (Backing::Small, None),
        (PageChoice::Auto, Some("always" | "madvise")) => (Backing::TransparentHuge, None),
        (PageChoice::Auto, Some(mode)) => (Backing::Small, Some(format!("transparent huge pages are off on this system ({mode})"))),
        (PageChoice::Auto, None) => (Backing::Small, Some("this kernel has no transparent huge pages".into())),
    }
}

/// Bytes a huge-page mapping of `bytes` of slots spans: whole 2 MiB pages.
fn huge_len(bytes: usize) -> usize {
    bytes.max(1).div_ceil(HUGE_PAGE) * HUGE_PAGE
}

/// What of the arena the kernel holds in memory (`Arena::pages_held`).
#[derive(Debug, Default, Clone, Copy)]
pub struct PagesHeld {
    /// Bytes backed by memory, of any page size.
    pub resident: u64,
    /// Bytes in huge pages.
    pub huge: u64,
}

/// The mapping. Invariants: `base..base+len` is a live private anonymous
/// mapping owned by this value; classes tile it without overlap from `base`.
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    /// The bytes the slots tile (at most `len`): what is ever touched.
    used: usize,
    classes: Vec<SlotClass>,
    backing: Backing,
    /// Why the arena has other pages than it was asked for.
    fallback: Option<String>,
    /// The huge-page bytes last read from /proc/self/smaps, and when.
    huge_seen: Mutex<Option<(Instant, u64)>>,
}

// SAFETY: the arena hands out slot memory only through `slot`/`slot_mut`,
// whose callers (the pager) guarantee exclusive access to a slot while it is
// written and no writer while it is read; the mapping itself is plain memory.
unsafe impl Send for Arena {}
// SAFETY: as above; &Arena methods never touch slot memory without that guarantee.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps an arena holding `counts[i]` slots of `expert_bytes[i]` bytes, on
    /// 4 KiB pages. Pages are only committed as slots are filled.
    pub fn new(classes: &[(usize, usize)]) -> io::Result<Arena> {
        Arena::with_pages(classes, PageChoice::Small)
    }

    /// [`Arena::new`] on the pages `choice` asks for, or what the system
    /// gives instead (see [`Arena::fallback`]).
    pub fn with_pages(classes: &[(usize, usize)], choice: PageChoice) -> io::Result<Arena> {
        let (backing, why) = backing_for(choice);
        if backing == Backing::ExplicitHuge {
            return match Arena::with_backing(classes, Backing::ExplicitHuge) {
                Ok(arena) => Ok(arena),
                Err(e) => {
                    let mut arena = Arena::with_pages(classes, PageChoice::Auto)?;
                    let why =
                        format!("the hugetlb pool cannot hold the arena's {} MiB ({e}; see vm.nr_hugepages)", huge_len(SlotClass::tile(classes)?.1) >> 20);
                    arena.fallback = Some(match arena.fallback.take() {
                        Some(more) => format!("{why}, and {more}"),
                        None => why,
                    });
                    Ok(arena)
                }
            };
        }
        let mut arena = Arena::with_backing(classes, backing)?;
        if arena.fallback.is_none() {
            arena.fallback = why;
        }
        Ok(arena)
    }

    /// [`Arena::new`] on the pages `backing` names, or an error where the
    /// hugetlb pool cannot hold it. For huge pages the mapping starts on a
    /// 2 MiB boundary and its length is rounded up to one, so every 2 MiB of
    /// it can be a huge page: the classes tile it end to end, and a slot may
    /// straddle two huge pages (nothing is padded; at most the last 2 MiB is
    /// partly unused).
    pub fn with_backing(classes: &[(usize, usize)], backing: Backing) -> io::Result<Arena> {
        let (out, bytes) = SlotClass::tile(classes)?;
        if backing == Backing::ExplicitHuge {
            let len = huge_len(bytes);
            // SAFETY: a fresh private mapping of reserved huge pages; no
            // existing memory is affected. Without MAP_NORESERVE the pool
            // must hold all of it now, or mmap fails (never a SIGBUS later).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let base = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
            return Ok(Arena { base, len, used: len, classes: out, backing, fallback: None, huge_seen: Mutex::new(None) });
        }
        let huge = backing == Backing::TransparentHuge;
        let (len, align) = if huge { (huge_len(bytes), HUGE_PAGE) } else { (bytes.max(SLOT_ALIGN), SLOT_ALIGN) };
        let span = len + (align - SLOT_ALIGN);
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = p as usize;
        let aligned = start.div_ceil(align) * align;
        // SAFETY: both ranges lie inside the mapping just made and outside
        // aligned..aligned+len, which is kept; unmapping them affects nothing else.
        unsafe {
            if aligned > start {
                libc::munmap(p, aligned - start);
            }
            let tail = start + span - (aligned + len);
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
        }
        let base = NonNull::new(aligned as *mut u8).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        let (mut backing, mut fallback) = (backing, None);
        // Huge pages only where whole ones lie inside the slots: a huge page
        // over the slots' last partial 2 MiB would hold up to 2 MiB more
        // than the arena was planned at (measured: 376 KiB over a budget).
        let huge_span = bytes / HUGE_PAGE * HUGE_PAGE;
        if huge && huge_span > 0 {
            // SAFETY: base..base+huge_span lies inside the live mapping;
            // MADV_HUGEPAGE only changes which pages later faults take.
            if unsafe { libc::madvise(base.as_ptr().cast(), huge_span, libc::MADV_HUGEPAGE) } != 0 {
                fallback = Some(format!("madvise(MADV_HUGEPAGE) failed: {}", io::Error::last_os_error()));
                backing = Backing::Small;
            }
        }
        Ok(Arena { base, len, used: bytes, classes: out, backing, fallback, huge_seen: Mutex::new(None) })
    }

    /// The pages behind the arena.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// Why the arena has other pages than it was asked for (None: as asked).
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Bytes of the arena backed by memory of any page size now, from
    /// `mincore` over the mapping (cheap: no smaps walk); None if it fails.
    pub fn resident_bytes(&self) -> Option<u64> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0)?;
        let mut core = vec![0u8; self.len.div_ceil(page)];
        // SAFETY: base..base+len is the live mapping (page-aligned), and
        // `core` has one byte for each of its pages, as mincore writes.
        if unsafe { libc::mincore(self.base.as_ptr().cast(), self.len, core.as_mut_ptr()) } != 0 {
            return None;
        }
        Some(core.iter().filter(|&&b| b & 1 != 0).count() as u64 * page as u64)
    }

    /// What of the arena the kernel holds now: bytes backed by memory of
    /// any page size (`resident_bytes`), and bytes in huge
    /// pages (`AnonHugePages` and `Private_Hugetlb` of its entries in
    /// /proc/self/smaps); None if either is unreadable. To write smaps the
    /// kernel walks every mapping's page tables, which took 2 % of the two
    /// cores during a far-past-RAM prompt when the stats file's snapshot
    /// (each second) read it: a huge-page figure read less than `huge_within`
    /// ago is given again instead.
    ///
    /// Not `Rss` from smaps: the kernel merges the arena's small-page part
    /// with an adjacent mapping of the same flags (glibc maps a thread's
    /// malloc heap MAP_NORESERVE, as the arena is), and that entry's `Rss`
    /// then counts the neighbour's pages too (CI saw 564 KiB "held" by an
    /// arena given back whole).
    pub fn pages_held(&self, huge_within: Duration) -> Option<PagesHeld> {
        let resident = self.resident_bytes()?;
        let mut seen = self.huge_seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, huge)) = *seen {
            if at.elapsed() < huge_within {
                return Some(PagesHeld { resident, huge: huge.min(resident) });
            }
        }
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let (lo, hi) = (self.base.as_ptr() as usize, self.base.as_ptr() as usize + self.len);
        // The bytes of the current entry inside the arena (0: outside).
        let mut overlap = 0u64;
        let mut huge = 0u64;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        overlap = b.min(hi).saturating_sub(a.max(lo)) as u64;
                        continue;
                    }
                }
            }
            if overlap == 0 {
                continue;
            }
            let Some((field, kb)) = line.split_once(':') else { continue };
            if field == "AnonHugePages" || field == "Private_Hugetlb" {
                let bytes = kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok()? * 1024;
                // A merged neighbour's huge pages cannot be told apart:
                // at most the entry's bytes inside the arena count.
                huge += bytes.min(overlap);
            }
        }
        *seen = Some((Instant::now(), huge));
        Some(PagesHeld { resident, huge: huge.min(resident) })
    }

    pub fn classes(&self) -> &[SlotClass] {
        &self.classes
    }

    /// Faults in every page of the mapping without writing to it: a fresh
    /// slot's first read then costs no page faults. Contents are unchanged.
    pub fn populate(&self) -> io::Result<()> {
        // SAFETY: base/len are the live mapping; MADV_POPULATE_WRITE
        // allocates missing pages, zeroed, and leaves present ones and all
        // contents as they are.
        let r = unsafe { libc::madvise(self.base.as_ptr().cast(), self.used.div_ceil(SLOT_ALIGN) * SLOT_ALIGN, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Faults in the pages of slot `id`, as `populate` does for the whole
    /// mapping. Safe while the slot is being read into or used: pages that
    /// are present, and every byte, stay as they are.
    pub fn populate_slot(&self, id: SlotId) -> io::Result<()> {
        let (off, _) = self.span(id);
        let len = self.classes[self.class_of(id)].slot_bytes;
        // SAFETY: the slot's whole region lies inside the live mapping;
        // MADV_POPULATE_WRITE only allocates missing pages (zeroed).
        let r = unsafe { libc::madvise(self.base.as_ptr().add(off).cast(), len, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Gives the pages of slots `ids` (consecutive, of one class) back to
    /// the kernel: their memory is freed at once, and they read as zeros
    /// until filled again (on hugetlb pages, only the whole 2 MiB pages
    /// inside the range). The mapping stays; a later fill faults pages in.
    ///
    /// # Safety
    /// No one may read or write these slots while this runs, nor rely on
    /// their contents afterwards (the pager calls it, under its lock, for
    /// slots that are retired, unpinned and hold no expert).
    pub unsafe fn discard(&self, ids: std::ops::Range<SlotId>) -> io::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let (mut off, mut len) = self.run_span(&ids);
        if self.backing == Backing::ExplicitHuge {
            // hugetlb pages are freed whole: only the 2 MiB pages inside
            // the range go back (the bytes of the others stay as they are).
            let (start, end) = (off.div_ceil(HUGE_PAGE) * HUGE_PAGE, (off + len) / HUGE_PAGE * HUGE_PAGE);
            if end <= start {
                return Ok(());
            }
            (off, len) = (start, end - start);
        }
        // SAFETY: the range lies inside the live mapping (class layout);
        // MADV_DONTNEED on private anonymous memory frees the pages and
        // leaves the mapping valid (zero-filled on next touch); the caller
        // guarantees no one uses these bytes.
        let r = unsafe { libc::madvise(self.base.as_ptr().add(off).cast(), len, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        if self.backing == Backing::TransparentHuge {
            // khugepaged would otherwise fill the freed range back in when
            // it collapses the huge pages around it (a 2 MiB range with a
            // single page present qualifies by default).
            self.advise(off, len, libc::MADV_NOHUGEPAGE)?;
        }
        Ok(())
    }

    /// Slots `ids` (consecutive, of one class), given back by `discard`,
    /// are to be used again: on transparent huge pages they ask for huge
    /// pages again. Their bytes are not touched.
    pub fn restore(&self, ids: std::ops::Range<SlotId>) -> io::Result<()> {
        if ids.is_empty() || self.backing != Backing::TransparentHuge {
            return Ok(());
        }
        let (off, len) = self.run_span(&ids);
        self.advise(off, len, libc::MADV_HUGEPAGE)
    }

    /// The bytes (offset, length) of slots `ids`, consecutive and of one class.
    fn run_span(&self, ids: &std::ops::Range<SlotId>) -> (usize, usize) {
        let c = &self.classes[self.class_of(ids.start)];
        assert!(ids.end <= c.first + c.count, "slots {ids:?} span more than one class");
        (c.offset + (ids.start - c.first) * c.slot_bytes, ids.len() * c.slot_bytes)
    }

    /// madvise(`advice`) on bytes off..off+len of the mapping; for advice
    /// that changes which pages later faults take, never the contents.
    fn advise(&self, off: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
        assert!(off + len <= self.len, "range outside the arena");
        // SAFETY: the range lies inside the live mapping; the callers pass
        // MADV_HUGEPAGE or MADV_NOHUGEPAGE, which leave every byte as it is.
        let r = unsafe { libc::madvise(self.base.as_ptr().add(off).cast(), len, advice) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Total bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.classes.iter().all(|c| c.count == 0)
    }

    pub fn n_slots(&self) -> usize {
        self.classes.iter().map(|c| c.count).sum()
    }

    /// The class slot `id` belongs to.
    pub fn class_of(&self, id: SlotId) -> usize {
        self.classes.iter().position(|c| c.slots().contains(&id)).expect("slot id in range")
    }

    fn span(&self, id: SlotId) -> (usize, usize) {
        let c = &self.classes[self.class_of(id)];
        (c.offset + (id - c.first) * c.slot_bytes, c.expert_bytes)
    }

    /// The bytes of slot `id`, for reading.
    ///
    /// # Safety
    /// No one may write slot `id` while the returned slice lives (the pager
    /// guarantees this by pinning a published slot).
    pub unsafe fn slot(&self, id: SlotId) -> &[u8] {
        let (off, len) = self.span(id);
        // SAFETY: off+len lies inside the live mapping (class layout); the
        // caller guarantees there is no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(off), len) }
    }

    /// The bytes of slot `id`, for filling.
    ///
    /// # Safety
    /// The caller must have exclusive access to slot `id` while the returned
    /// slice lives (the pager guarantees this for a slot it is loading:
    /// pinned, unpublished, and taken out of every eviction choice).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, id: SlotId) -> &mut [u8] {
        let (off, len) = self.span(id);
        // SAFETY: off+len lies inside the live mapping; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(off), len) }
    }

    /// Bytes `range` of slot `id`, for filling one part while other parts of
    /// the same slot are filled by other threads.
    ///
    /// # Safety
    /// The caller must have exclusive access to these bytes while the slice
    /// lives: the slot is being loaded (pinned, unpublished) and no other
    /// reader was given an overlapping range.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_range_mut(&self, id: SlotId, range: std::ops::Range<usize>) -> &mut [u8] {
        let (off, len) = self.span(id);
        assert!(range.start <= range.end && range.end <= len, "range {range:?} outside slot {id} of {len} bytes");
        // SAFETY: the range lies inside the slot, inside the live mapping;
        // exclusivity of these bytes is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(off + range.start), range.len()) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: base/len describe the mapping created in new(), unmapped once here.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// Moves the calling thread to the idle scheduling class (SCHED_IDLE): it
/// runs only on a core that nothing else wants. Returns false where the
/// kernel refuses.
pub fn idle_priority() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; param is a valid sched_param.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_tile_the_mapping() {
        let a = Arena::new(&[(5000, 3), (100, 2)]).unwrap();
        assert_eq!(a.n_slots(), 5);
        assert_eq!(a.classes()[0].slot_bytes, 8192);
        assert_eq!(a.classes()[1].slots(), 3..5);
        assert_eq!(a.len(), 3 * 8192 + 2 * 4096);
        // SAFETY: single-threaded test; each slot is written then read with no overlap.
        unsafe {
            for id in 0..5 {
                a.slot_mut(id).fill(id as u8 + 1);
            }
            for id in 0..5 {
                assert!(a.slot(id).iter().all(|&b| b == id as u8 + 1), "slot {id} overwritten");
            }
            assert_eq!(a.slot(4).len(), 100);
        }
    }

    #[test]
    fn a_huge_page_arena_starts_on_2_mib_and_keeps_every_byte() {
        let slots = [(2_039_808, 5), (1_000_000, 3)];
        let a = Arena::with_backing(&slots, Backing::TransparentHuge).unwrap();
        assert_eq!(a.base.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(a.len() % HUGE_PAGE, 0);
        assert!(a.len() >= a.classes()[1].offset + 3 * slot_bytes(1_000_000));
        // SAFETY: single-threaded test; slots are written, one discarded, then read.
        unsafe {
            for id in 0..8 {
                a.slot_mut(id).fill(id as u8 + 1);
            }
            a.discard(2..3).unwrap(); // part of two huge pages: the kernel splits them
            for id in 0..8 {
                let want = if id == 2 { 0 } else { id as u8 + 1 };
                assert!(a.slot(id).iter().all(|&b| b == want), "slot {id}");
            }
            a.restore(2..3).unwrap();
            a.slot_mut(2).fill(42);
            for id in 0..8 {
                let want = if id == 2 { 42 } else { id as u8 + 1 };
                assert!(a.slot(id).iter().all(|&b| b == want), "slot {id} after restore");
            }
        }
        if matches!(thp_mode().as_deref(), Some("always" | "madvise")) {
            assert_eq!(a.backing(), &Backing::TransparentHuge);
        }
        assert!(a.pages_held(Duration::ZERO).is_some());
    }

    #[test]
    fn discarded_slots_read_as_zeros_and_others_keep_their_bytes() {
        let a = Arena::new(&[(5000, 3)]).unwrap();
        // SAFETY: single-threaded test; nothing uses slots 1..3 while they are discarded.
        unsafe {
            for id in 0..3 {
                a.slot_mut(id).fill(7);
            }
            a.discard(1..3).unwrap();
            assert!(a.slot(0).iter().all(|&b| b == 7));
            assert!(a.slot(1).iter().chain(a.slot(2)).all(|&b| b == 0));
            a.slot_mut(2).fill(9);
            assert!(a.slot(2).iter().all(|&b| b == 9));
        }
    }

    #[test]
    fn pages_held_counts_the_arena_and_not_a_neighbour_merged_with_it() {
        // A neighbour as glibc makes one for a thread's malloc arena
        // (MAP_NORESERVE, read-write): right before the arena (mmap places
        // mappings top-down, so that range is usually free) or right after
        // it, where the kernel merges the two into one smaps entry. A new
        // arena is tried while both sides are taken (MAP_FIXED_NOREPLACE
        // never replaces a mapping).
        let neighbour = |at: usize| {
            // SAFETY: a fresh private anonymous mapping at `at`, or none.
            let p = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    1 << 20,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
                    -1,
                    0,
                )
            };
            (p != libc::MAP_FAILED).then_some(p)
        };
        let mut tried = Vec::new();
        let (a, next) = loop {
            let a = Arena::with_backing(&[(64 << 10, 4)], Backing::Small).unwrap();
            let (lo, hi) = (a.base.as_ptr() as usize, a.base.as_ptr() as usize + a.len());
            if let Some(p) = neighbour(lo - (1 << 20)).or_else(|| neighbour(hi)) {
                break (a, p);
            }
            assert!(tried.len() < 64, "no free range beside 64 arenas");
            tried.push(a);
        };
        // SAFETY: `next` is the 1 MiB mapping made above, unmapped at the
        // end; the arena's slots are used by nothing else in this test.
        unsafe {
            std::ptr::write_bytes(next.cast::<u8>(), 1, 1 << 20);
            assert_eq!(a.pages_held(Duration::ZERO).unwrap().resident, 0, "an untouched arena holds nothing");
            a.slot_mut(1).fill(3);
            assert_eq!(a.pages_held(Duration::ZERO).unwrap().resident, 64 << 10);
            a.discard(0..4).unwrap();
            assert_eq!(a.pages_held(Duration::ZERO).unwrap().resident, 0, "a discarded arena holds nothing");
            libc::munmap(next, 1 << 20);
        }
    }
}
