//! RAM budget and accounting: reading the process's anonymous RSS and swap
//! from `/proc/self/status`, the reserve rule, and how much of the budget
//! the expert arena may take.

use crate::error::{Error, Result};
use crate::units::{human, KIB, MIB};

/// The default reserve kept free of the arena for compute buffers, the KV
/// cache's growth and the allocator: budget / 16, clamped to [128 MiB, 1 GiB].
pub fn default_reserve(budget: u64) -> u64 {
    (budget / 16).clamp(128 * MIB, 1024 * MIB)
}

/// Memory figures of this process from `/proc/self/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcMemory {
    /// Resident anonymous memory (`RssAnon`, plus `HugetlbPages`): what the budget limits. File
    /// pages of the mmapped model are clean and reclaimable, so they do not count.
    pub rss_anon: u64,
    /// Peak resident set (`VmHWM`, includes file pages).
    pub vm_hwm: u64,
    /// Swapped-out anonymous memory (`VmSwap`).
    pub vm_swap: u64,
}

impl ProcMemory {
    /// Reads the current process's figures; zeros where the kernel does not report one.
    pub fn read() -> ProcMemory {
        std::fs::read_to_string("/proc/self/status").map(|s| Self::parse(&s)).unwrap_or_default()
    }

    fn parse(status: &str) -> ProcMemory {
        let mut m = ProcMemory::default();
        for line in status.lines() {
            let Some((key, rest)) = line.split_once(':') else { continue };
            let kib = rest.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0);
            match key {
                // hugetlb pages (an arena on SDQ_HUGEPAGES=hugetlb) are
                // anonymous memory the process holds, outside RssAnon.
                "RssAnon" | "HugetlbPages" => m.rss_anon += kib * KIB,
                "VmHWM" => m.vm_hwm = kib * KIB,
                "VmSwap" => m.vm_swap = kib * KIB,
                _ => {}
            }
        }
        m
    }
}

/// The soft limit on `resource` (`libc::RLIMIT_*`), if one is set.
fn rlimit(resource: libc::__rlimit_resource_t) -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    let ok = unsafe { libc::getrlimit(resource, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// `RLIMIT_DATA` if set: an upper bound on anonymous memory, never the budget.
pub fn rlimit_data() -> Option<u64> {
    rlimit(libc::RLIMIT_DATA)
}

/// A `/proc/meminfo` field in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map(|k| k * KIB)
}

pub fn mem_available() -> Option<u64> {
    meminfo("MemAvailable")
}

/// A budget far beyond this machine's RAM is a typo (`99999T` for `9999M`),
/// not a plan: no swap means it can never be honoured. A quarter over
/// `MemTotal` is allowed, for budgets written in round numbers.
pub fn check_against_ram(budget: u64) -> Result<()> {
    match meminfo("MemTotal") {
        Some(total) if budget > total + total / 4 => Err(Error::budget(
            budget,
            None,
            format!("--ram-budget {} is more than this machine's {} of RAM; sdq never swaps, so it could not be honoured", human(budget), human(total)),
        )),
        _ => Ok(()),
    }
}

/// `--ram-budget auto`: the tightest of this process's memory cgroup limit,
/// `MemAvailable` and `RLIMIT_AS`, with where it came from.
pub fn auto_budget() -> Option<(u64, &'static str)> {
    [
        (crate::engine::memory::cgroup::cgroup_limit(), "the memory cgroup's limit"),
        (mem_available(), "MemAvailable in /proc/meminfo"),
        (rlimit(libc::RLIMIT_AS), "RLIMIT_AS"),
    ]
    .into_iter()
    .filter_map(|(v, s)| v.map(|v| (v, s)))
    .min_by_key(|(v, _)| *v)
}

/// What the process holds outside the arena when the pager starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Anonymous RSS: KV cache, compute buffers, repacked weights.
    pub anon: u64,
    /// Weights left in the file mapping that every token reads (all but the
    /// embedding, which is read a row per token). They are page cache, not
    /// anonymous memory, but under a limit that counts page cache (a cgroup,
    /// or simply a machine of the budget's size) they must stay resident:
    /// evicted, they are read back from disk on every token.
    pub mapped: u64,
}

/// What the arena may take: budget − anonymous RSS − mapped weights −
/// reserve, never more than what `RLIMIT_DATA` leaves (which counts anonymous
/// memory only). Errors name the figures when nothing is left.
pub fn arena_bytes(budget: u64, reserve: u64, held: Held, rlimit: Option<u64>) -> Result<u64> {
    let used = held.anon.saturating_add(held.mapped).saturating_add(reserve);
    if used >= budget {
        return Err(Error::budget(
            budget,
            None,
            format!(
                "RAM budget {} leaves nothing for experts: the process already holds {} anonymous memory and {} of mapped weights, and the reserve is {}",
                human(budget),
                human(held.anon),
                human(held.mapped),
                human(reserve)
            ),
        ));
    }
    let mut arena = budget - used;
    if let Some(limit) = rlimit {
        arena = arena.min(limit.saturating_sub(held.anon));
    }
    Ok(arena)
}

/// This process's page faults so far: (minor, major).
pub fn page_faults() -> (u64, u64) {
    // SAFETY: getrusage fills the struct we pass and reads nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return (0, 0);
    }
    (ru.ru_minflt.max(0) as u64, ru.ru_majflt.max(0) as u64)
}

/// CPU time the calling thread has used, in nanoseconds (0 where the clock
/// is unavailable): what a piece of work cost, whatever else shared the cores.
pub fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which t is.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
    if ok {
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    } else {
        0
    }
}

/// Allocations of this size or more are mapped on their own.
const MMAP_THRESHOLD: i32 = 1 << 20;

/// From now on, makes every allocation of 1 MiB or more a mapping of its
/// own, unmapped when freed. glibc otherwise raises its threshold to the size
/// of each such block freed (up to 32 MiB), so the next ones come from the
/// heap, which keeps their pages once they are freed: a prompt group's
/// staged ubatches and kept outputs, freed when the group ends, stayed in
/// RSS while the arena filled again the slots it had lent them, past the
/// budget. Set when the first group is staged, so that what a process holds
/// after load (which `sdq inspect` predicts) is as before.
pub fn return_large_frees() {
    static SET: std::sync::Once = std::sync::Once::new();
    SET.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only sets one of the allocator's parameters.
        unsafe {
            if libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 {
                log::debug!("mallopt(M_MMAP_THRESHOLD) refused: freed buffers may stay in the heap");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn reserve_rule() {
        assert_eq!(default_reserve(8 * GIB), 512 * MIB);
        assert_eq!(default_reserve(4 * GIB), 256 * MIB);
        assert_eq!(default_reserve(GIB), 128 * MIB);
        assert_eq!(default_reserve(64 * GIB), 1024 * MIB);
    }

    #[test]
    fn status_parsing() {
        let s = "Name:\tx\nVmHWM:\t  2048 kB\nRssAnon:\t  1024 kB\nVmSwap:\t       0 kB\n";
        assert_eq!(ProcMemory::parse(s), ProcMemory { rss_anon: MIB, vm_hwm: 2 * MIB, vm_swap: 0 });
        assert!(ProcMemory::read().rss_anon > 0);
    }

    #[test]
    fn arena_sizing() {
        let held = Held { anon: GIB, mapped: 0 };
        assert_eq!(arena_bytes(8 * GIB, 512 * MIB, held, None).unwrap(), 8 * GIB - GIB - 512 * MIB);
        assert_eq!(arena_bytes(8 * GIB, 512 * MIB, held, Some(2 * GIB)).unwrap(), GIB);
        let held = Held { anon: GIB, mapped: GIB };
        assert_eq!(arena_bytes(8 * GIB, 512 * MIB, held, None).unwrap(), 6 * GIB - 512 * MIB);
        // RLIMIT_DATA counts anonymous memory only: mapped weights do not eat into it.
        assert_eq!(arena_bytes(8 * GIB, 512 * MIB, held, Some(3 * GIB)).unwrap(), 2 * GIB);
        assert!(matches!(arena_bytes(2 * GIB, 512 * MIB, held, None), Err(Error::Budget { budget, minimum: None, .. }) if budget == 2 * GIB));
        let e = arena_bytes(2 * GIB, 512 * MIB, held, None).unwrap_err().to_string();
        assert!(e.contains("1.00 GiB") && e.contains("512.0 MiB"), "{e}");
    }
}
