//! Memory pressure: how much room the process has now, and the arena that
//! fits in it. The room is the budget, cut by the memory cgroup's limits
//! (hard or soft, read each time: an administrator may lower them under a
//! running server) and, with `--ram-budget auto`, by MemAvailable plus what
//! the process already holds. Whatever the room lacks of the budget, the
//! arena gives back, down to one layer's top-k; when room returns, it grows
//! back to its plan. The runtime's memory thread polls `Watch::poll`. A
//! prompt group whose staged ubatches need more than their allowance of
//! the reserve borrows the rest from the arena for the group's compute
//! (`Watch::lend`), where the arena keeps a layer's experts and half more.

use crate::engine::pager::Pager;
use crate::units::{human, MIB};

/// What the process may hold at most, as last read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// The tightest cgroup limit on this process (hard or soft).
    pub cgroup: Option<u64>,
    /// MemAvailable plus this process's anonymous memory: what it could
    /// hold if it took all that is free (only with `--ram-budget auto`).
    pub available: Option<u64>,
}

/// MemAvailable moves by tens of MiB with other processes' page cache: the
/// arena yields only to a fall larger than this.
const AVAILABLE_GRACE: u64 = 64 * MIB;

/// The arena grows back in steps of at least this (or to its plan), so
/// that a room hovering near one value does not resize it every poll.
const GROW_STEP: u64 = 32 * MIB;

/// The arena's bounds and the budget it was planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub budget: u64,
    /// The arena the budget gave at start (its most).
    pub arena: u64,
    /// One layer's top-k experts of each slot class (its least).
    pub min_arena: u64,
}

impl Plan {
    /// The room `r` leaves, and which limit set it.
    pub fn room(&self, r: Reading) -> (u64, &'static str) {
        let mut room = (self.budget, "the budget");
        if let Some(c) = r.cgroup.filter(|&c| c < room.0) {
            room = (c, "the memory cgroup's limit");
        }
        if let Some(a) = r.available.map(|a| a.saturating_add(AVAILABLE_GRACE)).filter(|&a| a < room.0) {
            room = (a, "MemAvailable");
        }
        room
    }

    /// The arena that fits `room`: the plan less what the room lacks of
    /// the budget, within the arena's bounds.
    pub fn arena_for(&self, room: u64) -> u64 {
        self.arena.saturating_sub(self.budget.saturating_sub(room)).clamp(self.min_arena, self.arena)
    }
}

/// Reads the room now, for a process holding `rss_anon` of anonymous memory.
pub fn read(auto: bool, rss_anon: u64) -> Reading {
    Reading {
        cgroup: crate::engine::memory::cgroup::cgroup_limit(),
        available: if auto { crate::engine::memory::budget::mem_available().map(|a| a + rss_anon) } else { None },
    }
}

/// The arena's size over the run, and its changes.
#[derive(Debug)]
pub struct Watch {
    plan: Plan,
    auto: bool,
    /// The arena's size now (what the slots in use may take).
    pub arena: u64,
    pub shrinks: u64,
    pub grows: u64,
    /// The smallest the arena has been under pressure (not counting what
    /// it lent a prompt group).
    pub smallest: u64,
    /// The room at the last poll.
    pub room: u64,
    /// What the arena lends the prompt group being staged or computed.
    lent: u64,
}

/// Why the arena changes size.
#[derive(Clone, Copy)]
enum Resize {
    /// The room, and the limit that set it.
    Room(&'static str),
    /// A prompt group borrows, or gives back.
    Group,
}

impl Watch {
    pub fn new(plan: Plan, auto: bool) -> Watch {
        Watch { plan, auto, arena: plan.arena, shrinks: 0, grows: 0, smallest: plan.arena, room: plan.budget, lent: 0 }
    }

    /// The arena the room leaves, less what a prompt group borrows.
    fn target(&self) -> u64 {
        self.plan.arena_for(self.room).saturating_sub(self.lent).max(self.plan.min_arena)
    }

    /// What the arena could lend a prompt group in all (counting what it
    /// lends now) and still hold `floor`.
    pub fn lendable(&self, floor: u64) -> u64 {
        self.plan.arena_for(self.room).saturating_sub(floor.max(self.plan.min_arena))
    }

    /// What the arena lends now.
    pub fn lent(&self) -> u64 {
        self.lent
    }

    /// Lends `bytes` more of the arena to a prompt group's staged ubatches:
    /// slots past the smaller arena give their memory back before the
    /// next ubatch is staged (a slot being read gives it when its read
    /// ends). The caller has checked `lendable`.
    pub fn lend(&mut self, bytes: u64, pager: &Pager, top_k: usize) {
        self.lent += bytes;
        self.resize(self.target(), Resize::Group, pager, top_k);
    }

    /// The group is done: the arena takes back what it lent.
    pub fn give_back(&mut self, pager: &Pager, top_k: usize) {
        if self.lent > 0 {
            self.lent = 0;
            self.resize(self.target(), Resize::Group, pager, top_k);
        }
    }

    /// Reads the room and resizes the pager's arena if it no longer fits
    /// (or fits again); each change is one notice on stderr. `rss_anon`:
    /// the process's anonymous memory, as just sampled.
    pub fn poll(&mut self, pager: &Pager, top_k: usize, rss_anon: u64) {
        let reading = read(self.auto, rss_anon);
        self.apply(reading, pager, top_k);
    }

    /// As `poll`, for a given reading.
    pub fn apply(&mut self, reading: Reading, pager: &Pager, top_k: usize) {
        let (room, cause) = self.plan.room(reading);
        self.room = room;
        let target = self.target();
        let grow = target > self.arena && (target == self.plan.arena || target - self.arena >= GROW_STEP);
        if target >= self.arena && !grow {
            return;
        }
        self.resize(target, Resize::Room(cause), pager, top_k);
    }

    fn resize(&mut self, target: u64, why: Resize, pager: &Pager, top_k: usize) {
        let counts = match pager.layout().plan_slots(target, top_k) {
            Ok(slots) => slots.into_iter().map(|(_, n)| n).collect::<Vec<_>>(),
            Err(e) => {
                log::warn!("cannot plan an arena of {}: {e}", human(target));
                return;
            }
        };
        // An arena planned larger than every expert needs (the budget holds
        // them all) first gives back what it never used: no slot changes.
        if counts != pager.slots_in_use() {
            let before = pager.arena_bytes_in_use();
            let now = pager.set_slots(&counts, top_k);
            match why {
                Resize::Group if self.lent > 0 => {
                    log::info!("the expert arena lends a prompt group {} and holds {} (of its {})", human(self.lent), human(now), human(self.plan.arena))
                }
                Resize::Group => log::info!("the prompt group gave the arena back its loan: it holds {} (of its {})", human(now), human(self.plan.arena)),
                Resize::Room(cause) if target < self.arena => {
                    self.shrinks += 1;
                    stderr_line!(
                        "sdq: notice: {cause} leaves {} of room: the expert arena gives back {} and now holds {} (of its {})",
                        human(self.room),
                        human(before.saturating_sub(now)),
                        human(now),
                        human(self.plan.arena)
                    );
                }
                Resize::Room(_) => {
                    self.grows += 1;
                    stderr_line!(
                        "sdq: notice: room is back to {}: the expert arena grows to {} (of its {})",
                        human(self.room),
                        human(now),
                        human(self.plan.arena)
                    );
                }
            }
        }
        self.arena = target;
        if matches!(why, Resize::Room(_)) {
            self.smallest = self.smallest.min(target);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn the_arena_gives_back_what_the_room_lacks_of_the_budget() {
        let plan = Plan { budget: 4 * GIB, arena: 3 * GIB, min_arena: 16 * MIB };
        let none = Reading::default();
        assert_eq!(plan.room(none), (4 * GIB, "the budget"));
        assert_eq!(plan.arena_for(plan.room(none).0), 3 * GIB);
        // A cgroup limit above the budget changes nothing; one GiB below takes one GiB.
        assert_eq!(plan.arena_for(plan.room(Reading { cgroup: Some(6 * GIB), available: None }).0), 3 * GIB);
        let r = Reading { cgroup: Some(3 * GIB), available: None };
        assert_eq!(plan.room(r), (3 * GIB, "the memory cgroup's limit"));
        assert_eq!(plan.arena_for(3 * GIB), 2 * GIB);
        // Less than the arena holds: down to one layer's top-k, not below.
        assert_eq!(plan.arena_for(GIB / 2), 16 * MIB);
        // MemAvailable counts only past its grace, and the tightest limit wins.
        let r = Reading { cgroup: Some(3 * GIB), available: Some(3 * GIB) };
        assert_eq!(plan.room(r).1, "the memory cgroup's limit");
        let r = Reading { cgroup: Some(3 * GIB), available: Some(2 * GIB) };
        assert_eq!(plan.room(r), (2 * GIB + AVAILABLE_GRACE, "MemAvailable"));
    }
}
