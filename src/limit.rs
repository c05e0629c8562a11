//! Running a command inside an enforced memory limit: a memory cgroup (v2
//! `memory.max` + `memory.swap.max = 0`, or v1 `memory.limit_in_bytes` +
//! `memory.memsw.limit_in_bytes`) created under this process's own cgroup,
//! removed afterwards. The kernel counts page cache against the limit, so a
//! run that fits is one that really fits. Where no memory cgroup is writable,
//! the command runs unconfined and only its RSS is measured, and the report
//! says so. Also: the memory limit that applies to this process, for
//! `--ram-budget auto`.

use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Instant;

/// The running command's pid, for the signal forwarder (0: none).
static CHILD: AtomicI32 = AtomicI32::new(0);

/// Forwards SIGINT/SIGTERM/SIGHUP to the command, so the runner itself
/// lives on to collect the report and remove its cgroup.
extern "C" fn forward_signal(sig: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe and touches no memory of ours.
        unsafe { libc::kill(pid, sig) };
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// This process's memory cgroup directory and its version.
fn own_memory_cgroup() -> Option<(PathBuf, Version)> {
    let text = fs::read_to_string("/proc/self/cgroup").ok()?;
    if Path::new("/sys/fs/cgroup/cgroup.controllers").is_file() {
        let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        return Some((Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/')), Version::V2));
    }
    let rel = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers.split(',').any(|c| c == "memory").then(|| path.to_string())
    })?;
    Some((Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/')), Version::V1))
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` lines (memory.stat, memory.events, memory.oom_control).
fn keyed(path: &Path, key: &str) -> Option<u64> {
    fs::read_to_string(path).ok()?.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The tightest memory limit on this process's cgroup and its ancestors.
pub fn cgroup_limit() -> Option<u64> {
    let (mut dir, v) = own_memory_cgroup()?;
    let root = match v {
        Version::V1 => Path::new("/sys/fs/cgroup/memory"),
        Version::V2 => Path::new("/sys/fs/cgroup"),
    };
    let mut best: Option<u64> = None;
    loop {
        let limit = match v {
            // v1 reports "no limit" as a huge page-rounded number
            Version::V1 => read_u64(&dir.join("memory.limit_in_bytes")).filter(|&l| l < 1 << 60),
            Version::V2 => read_u64(&dir.join("memory.max")), // "max" does not parse
        };
        if let Some(l) = limit {
            best = Some(best.map_or(l, |b| b.min(l)));
        }
        if dir == root || !dir.pop() {
            return best;
        }
    }
}

/// A memory cgroup this runner created; removed when dropped.
struct Cgroup {
    dir: PathBuf,
    version: Version,
}

impl Cgroup {
    fn create(limit: u64) -> std::result::Result<Cgroup, String> {
        let (parent, version) = own_memory_cgroup().ok_or("no memory cgroup in /proc/self/cgroup")?;
        let dir = parent.join(format!("sdq-limit-{}", std::process::id()));
        fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let cg = Cgroup { dir, version };
        let set = |file: &str, value: String| {
            fs::write(cg.dir.join(file), &value).map_err(|e| format!("cannot set {file} = {value} in {}: {e}", cg.dir.display()))
        };
        match version {
            Version::V1 => {
                set("memory.limit_in_bytes", limit.to_string())?;
                // memory+swap = memory: no swap at all (absent without swap accounting)
                if cg.dir.join("memory.memsw.limit_in_bytes").exists() {
                    set("memory.memsw.limit_in_bytes", limit.to_string())?;
                }
            }
            Version::V2 => {
                if !cg.dir.join("memory.max").exists() {
                    // v2's no-internal-process rule: a cgroup that holds
                    // processes (ours) cannot hand the memory controller down.
                    return Err(format!(
                        "the memory controller is not enabled below {} (its cgroup.subtree_control lacks \"memory\"); \
                         run sdq limit inside a delegated cgroup, e.g. `systemd-run --user --scope -p Delegate=yes sdq limit ...`",
                        parent.display()
                    ));
                }
                set("memory.max", limit.to_string())?;
                if cg.dir.join("memory.swap.max").exists() {
                    set("memory.swap.max", "0".into())?;
                }
            }
        }
        Ok(cg)
    }

    fn measurements(&self) -> Value {
        let d = &self.dir;
        match self.version {
            Version::V1 => json!({
                "peak_bytes": read_u64(&d.join("memory.max_usage_in_bytes")),
                "peak_memsw_bytes": read_u64(&d.join("memory.memsw.max_usage_in_bytes")),
                "limit_hits": read_u64(&d.join("memory.failcnt")),
                "oom_kills": keyed(&d.join("memory.oom_control"), "oom_kill").unwrap_or(0),
                "major_faults": keyed(&d.join("memory.stat"), "pgmajfault"),
                "swap_bytes": keyed(&d.join("memory.stat"), "swap").unwrap_or(0),
            }),
            Version::V2 => json!({
                "peak_bytes": read_u64(&d.join("memory.peak")),
                "oom_kills": keyed(&d.join("memory.events"), "oom_kill").unwrap_or(0),
                "major_faults": keyed(&d.join("memory.stat"), "pgmajfault"),
                "swap_bytes": read_u64(&d.join("memory.swap.peak")).or(read_u64(&d.join("memory.swap.current"))).unwrap_or(0),
            }),
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The command has exited; its cgroup empties as the kernel reaps it.
        for _ in 0..50 {
            if fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        log::warn!("could not remove {}", self.dir.display());
    }
}

/// Peak RSS of this process's waited-for children (KiB → bytes).
fn children_max_rss() -> u64 {
    // SAFETY: getrusage fills the struct we pass and reads nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    ru.ru_maxrss.max(0) as u64 * 1024
}

/// Runs `argv` with at most `limit` bytes of memory (page cache included, no
/// swap). Returns the report; the command's output passes through.
pub fn run_limited(limit: u64, argv: &[String]) -> Result<Value> {
    let (program, args) = argv.split_first().ok_or_else(|| Error::invalid("no command to run"))?;
    let started = Instant::now();
    let (cgroup, mode) = match Cgroup::create(limit) {
        Ok(cg) => {
            let mode = match cg.version {
                Version::V1 => "cgroup v1 (memory.limit_in_bytes, memory.memsw.limit_in_bytes)",
                Version::V2 => "cgroup v2 (memory.max, memory.swap.max = 0)",
            };
            (Some(cg), mode.to_string())
        }
        Err(why) => (None, format!("NOT ENFORCED, RSS only: {why}")),
    };
    let mut cmd = match &cgroup {
        // The shell joins the cgroup, then becomes the command.
        Some(cg) => {
            let mut c = Command::new("/bin/sh");
            c.arg("-c").arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#).arg(&cg.dir).arg(program).args(args);
            c
        }
        None => {
            let mut c = Command::new(program);
            c.args(args);
            c
        }
    };
    let mut child = cmd.spawn().map_err(|e| Error::io("cannot run", Path::new(program), e))?;
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs a handler that only calls kill (async-signal-safe).
        unsafe { libc::signal(sig, forward_signal as *const () as libc::sighandler_t) };
    }
    let status = child.wait().map_err(|e| Error::io("waiting for", Path::new(program), e))?;
    CHILD.store(0, Ordering::SeqCst);
    let mut report = json!({
        "command": argv,
        "limit_bytes": limit,
        "enforced": cgroup.is_some(),
        "mode": mode,
        "exit_code": status.code(),
        "signal": std::os::unix::process::ExitStatusExt::signal(&status),
        "seconds": started.elapsed().as_secs_f64(),
        "child_peak_rss_bytes": children_max_rss(),
    });
    if let Some(cg) = &cgroup {
        if let (Some(o), Value::Object(m)) = (report.as_object_mut(), cg.measurements()) {
            o.extend(m);
        }
    }
    drop(cgroup);
    Ok(report)
}
