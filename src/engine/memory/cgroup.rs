//! Memory cgroups as sdq reads them (v1 and v2): which cgroup a process is
//! in, its limits and what it is charged. `--ram-budget auto` and the
//! arena's pressure watch take the limit that applies to this process;
//! `sdq limit` creates and changes cgroups with the same readers.

use std::fs;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// This process's memory cgroup directory and its version.
pub fn own_memory_cgroup() -> Option<(PathBuf, Version)> {
    memory_cgroup_of("self")
}

/// The memory cgroup directory of process `pid` ("self" or a number) and its version.
pub fn memory_cgroup_of(pid: &str) -> Option<(PathBuf, Version)> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    if Path::new("/sys/fs/cgroup/cgroup.controllers").is_file() {
        let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        return Some((Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/')), Version::V2));
    }
    Some((v1_cgroup_in(&text, "memory")?, Version::V1))
}

/// The directory of the v1 cgroup of `controller` ("memory", "blkio") that
/// a `/proc/PID/cgroup` text names.
pub fn v1_cgroup_in(proc_cgroup: &str, controller: &str) -> Option<PathBuf> {
    proc_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers.split(',').any(|c| c == controller).then(|| Path::new("/sys/fs/cgroup").join(controller).join(path.trim_start_matches('/')))
    })
}

pub fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` lines (memory.stat, memory.events, memory.oom_control).
pub fn keyed(path: &Path, key: &str) -> Option<u64> {
    fs::read_to_string(path).ok()?.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A cgroup's hard memory limit (`memory.max` / `memory.limit_in_bytes`), if set.
pub fn hard_limit(dir: &Path, v: Version) -> Option<u64> {
    match v {
        // v1 reports "no limit" as a huge page-rounded number
        Version::V1 => read_u64(&dir.join("memory.limit_in_bytes")).filter(|&l| l < 1 << 60),
        Version::V2 => read_u64(&dir.join("memory.max")), // "max" does not parse
    }
}

/// A cgroup's soft limit (`memory.high` / `memory.soft_limit_in_bytes`), if
/// set: past it the kernel throttles (v2) or reclaims first (v1), and
/// `change_limit` sets it first to tell a process to shrink.
pub fn soft_limit(dir: &Path, v: Version) -> Option<u64> {
    match v {
        Version::V1 => read_u64(&dir.join("memory.soft_limit_in_bytes")).filter(|&l| l < 1 << 60),
        Version::V2 => read_u64(&dir.join("memory.high")),
    }
}

/// The tightest memory limit, hard or soft, on this process's cgroup and
/// its ancestors.
pub fn cgroup_limit() -> Option<u64> {
    let (mut dir, v) = own_memory_cgroup()?;
    let root = match v {
        Version::V1 => Path::new("/sys/fs/cgroup/memory"),
        Version::V2 => Path::new("/sys/fs/cgroup"),
    };
    let mut best: Option<u64> = None;
    loop {
        for l in [hard_limit(&dir, v), soft_limit(&dir, v)].into_iter().flatten() {
            best = Some(best.map_or(l, |b| b.min(l)));
        }
        if dir == root || !dir.pop() {
            return best;
        }
    }
}

/// Anonymous memory charged to a cgroup: what no reclaim can take (there
/// is no swap), so what a lower hard limit must leave room for.
pub fn anon_bytes(dir: &Path, v: Version) -> Option<u64> {
    match v {
        Version::V1 => keyed(&dir.join("memory.stat"), "total_rss").or_else(|| keyed(&dir.join("memory.stat"), "rss")),
        Version::V2 => keyed(&dir.join("memory.stat"), "anon"),
    }
}
