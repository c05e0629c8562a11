//! Running a command inside an enforced memory limit: a memory cgroup (v2
//! `memory.max` + `memory.swap.max = 0`, or v1 `memory.limit_in_bytes` +
//! `memory.memsw.limit_in_bytes`) created under this process's own cgroup,
//! removed afterwards. The kernel counts page cache against the limit, so a
//! run that fits is one that really fits. Where no memory cgroup is writable,
//! the command runs unconfined and only its RSS is measured, and the report
//! says so. Also: changing a running process's limit without the kernel
//! killing it (`change_limit`: the soft limit first, so the process can give
//! memory back before the hard limit falls). And, on request, a cap on the
//! rate the command reads from the machine's disks (`ReadCap`), so that "the
//! disk's rate" is a figure the kernel enforces where the real one is not
//! known (a virtual disk the host caches).

use crate::engine::memory::cgroup::{anon_bytes, hard_limit, keyed, memory_cgroup_of, own_memory_cgroup, read_u64, soft_limit, v1_cgroup_in, Version};
use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Instant;

/// The running command's pid, for the signal forwarder (0: none).
static CHILD: AtomicI32 = AtomicI32::new(0);

/// A signal that came before the command was running, to forward once it is (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);

/// Forwards SIGINT/SIGTERM/SIGHUP to the command, so the runner itself
/// lives on to collect the report and remove its cgroup. Installed before
/// the cgroup is made: a signal before the command runs would otherwise
/// end the runner and leave its cgroup behind; it is kept and forwarded
/// once the command runs.
extern "C" fn forward_signal(sig: libc::c_int) {
    let pid = CHILD.load(Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe and touches no memory of ours.
        unsafe { libc::kill(pid, sig) };
    } else {
        PENDING.store(sig, Ordering::SeqCst);
    }
}

/// Page cache and kernel memory the cgroup keeps under a lowered limit
/// besides its anonymous memory: a hard limit is set only once anonymous
/// memory is this far below it.
const LOWER_MARGIN: u64 = 16 << 20;

/// Sets the memory limit of process `pid`'s cgroup to `limit`, the way a
/// running process survives. Lowering: the soft limit first; a process
/// watching it (sdq's arena) gives memory back; once the cgroup's anonymous
/// memory fits under `limit` (within `wait`), the hard limit follows (v1 and
/// v2 no swap: the kernel reclaims page cache, then refuses (v1) or kills
/// (v2) rather than take anonymous memory). Raising: the hard limit first,
/// then the soft one. Returns a report; errors name the cgroup and figures,
/// and leave the old limits in place.
pub fn change_limit(pid: u32, limit: u64, wait: std::time::Duration) -> Result<Value> {
    let (dir, v) = memory_cgroup_of(&pid.to_string()).ok_or_else(|| Error::invalid(format!("process {pid}: no memory cgroup in /proc/{pid}/cgroup")))?;
    let started = Instant::now();
    let old_hard = hard_limit(&dir, v);
    let old_soft = soft_limit(&dir, v);
    let write =
        |file: &str, value: &str| -> Result<()> { fs::write(dir.join(file), value).map_err(|e| Error::io(format!("cannot set {file} = {value} in"), &dir, e)) };
    let (hard, soft): (&[&str], &str) = match v {
        // memory+swap must stay at least memory: lowered after, raised before it.
        Version::V1 => (&["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"], "memory.soft_limit_in_bytes"),
        Version::V2 => (&["memory.max"], "memory.high"),
    };
    let hard: Vec<&str> = hard.iter().copied().filter(|f| dir.join(f).exists()).collect();
    let value = limit.to_string();
    let anon_before = anon_bytes(&dir, v);
    let lowering = old_hard.map_or(true, |h| limit < h);
    if lowering {
        write(soft, &value)?;
        let fits = || anon_bytes(&dir, v).is_some_and(|a| a + LOWER_MARGIN <= limit);
        while !fits() && started.elapsed() < wait {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let mut set = Ok(());
        for f in &hard {
            set = write(f, &value);
            if set.is_err() {
                break;
            }
        }
        if let Err(e) = set {
            let restore = old_soft.map_or_else(|| "-1".to_string(), |s| s.to_string());
            let restore = if v == Version::V2 && old_soft.is_none() { "max".to_string() } else { restore };
            let _ = write(soft, &restore);
            return Err(Error::invalid(format!(
                "{e}: process {pid} still holds {} of anonymous memory after {:.1} s (the limit asked for is {}); the old limits stay",
                crate::units::human(anon_bytes(&dir, v).unwrap_or(0)),
                started.elapsed().as_secs_f64(),
                crate::units::human(limit)
            )));
        }
    } else {
        for f in hard.iter().rev() {
            write(f, &value)?;
        }
        write(soft, &value)?;
    }
    Ok(json!({
        "pid": pid,
        "cgroup": dir.display().to_string(),
        "old_limit_bytes": old_hard,
        "limit_bytes": limit,
        "anon_before_bytes": anon_before,
        "anon_after_bytes": anon_bytes(&dir, v),
        "seconds": started.elapsed().as_secs_f64(),
    }))
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
        let set =
            |file: &str, value: String| fs::write(cg.dir.join(file), &value).map_err(|e| format!("cannot set {file} = {value} in {}: {e}", cg.dir.display()));
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
        remove_cgroup(&self.dir);
    }
}

/// Removes a cgroup this runner made. The command has exited; its cgroup
/// empties as the kernel reaps it, so the first tries may find it busy.
fn remove_cgroup(dir: &Path) {
    for _ in 0..50 {
        if fs::remove_dir(dir).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    log::warn!("could not remove {}", dir.display());
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
pub fn run_limited(limit: u64, read_rate: Option<u64>, argv: &[String]) -> Result<Value> {
    let (program, args) = argv.split_first().ok_or_else(|| Error::invalid("no command to run"))?;
    // From here a signal must not end the runner before it has removed
    // what it made: the handler keeps it for the command.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs a handler that only calls kill (async-signal-safe)
        // or stores to an atomic. The command gets the default back at exec.
        unsafe { libc::signal(sig, forward_signal as *const () as libc::sighandler_t) };
    }
    // A cap asked for and not enforced would make every figure read under it
    // wrong, so unlike the memory limit it has no unenforced fallback.
    let read_cap = read_rate.map(ReadCap::create).transpose()?;
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
    if let Some(cap) = read_cap.as_ref().filter(|c| c.dir.is_none()) {
        match &cgroup {
            Some(cg) => cap.set_v2(&cg.dir)?,
            None => return Err(Error::flag("--read-rate", format!("--read-rate: cgroup v2 caps reads on the memory cgroup, and none was made ({mode})"))),
        }
    }
    let joins: Vec<&Path> = cgroup.iter().map(|cg| cg.dir.as_path()).chain(read_cap.iter().filter_map(|r| r.dir.as_deref())).collect();
    let mut cmd = if joins.is_empty() {
        let mut c = Command::new(program);
        c.args(args);
        c
    } else {
        // The shell joins the cgroups (memory, and blkio where it is a
        // hierarchy of its own), then becomes the command.
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg(r#"while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@""#)
            .arg("sdq-limit")
            .args(joins)
            .arg("--")
            .arg(program)
            .args(args);
        c
    };
    let mut child = cmd.spawn().map_err(|e| Error::io("cannot run", Path::new(program), e))?;
    CHILD.store(child.id() as i32, Ordering::SeqCst);
    let pending = PENDING.swap(0, Ordering::SeqCst);
    if pending != 0 {
        // SAFETY: signalling our own child, which has not been waited for.
        unsafe { libc::kill(child.id() as i32, pending) };
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
    if let (Some(cap), Some(o)) = (&read_cap, report.as_object_mut()) {
        o.insert("read_rate_bytes_per_s".into(), json!(cap.rate));
        o.insert("read_capped_devices".into(), json!(cap.devices));
        o.insert("disk_read_bytes".into(), json!(cap.read_bytes(cgroup.as_ref())));
    }
    drop(cgroup);
    drop(read_cap);
    Ok(report)
}

/// A cap on the rate the command reads from the machine's disks, one rule
/// per whole disk (`/sys/block/*` with a device behind it): cgroup v1's
/// `blkio.throttle.read_bps_device` in a blkio cgroup of its own, or v2's
/// `io.max rbps=` on the memory cgroup `Cgroup::create` made (the same
/// directory there). Reads past the cap wait in the block layer, whatever
/// serves them: the disk or a host's cache of a virtual disk.
struct ReadCap {
    /// The v1 blkio cgroup this cap created (v2 sets the memory cgroup's).
    dir: Option<PathBuf>,
    rate: u64,
    /// "MAJ:MIN" of each capped disk.
    devices: Vec<String>,
}

impl ReadCap {
    fn create(rate: u64) -> Result<ReadCap> {
        let devices = whole_disks();
        if devices.is_empty() {
            return Err(Error::flag("--read-rate", "--read-rate: no disk in /sys/block to cap"));
        }
        if Path::new("/sys/fs/cgroup/cgroup.controllers").is_file() {
            // v2: the rules go on the memory cgroup once it exists (set_v2).
            return Ok(ReadCap { dir: None, rate, devices });
        }
        let text = fs::read_to_string("/proc/self/cgroup").map_err(|e| Error::io("cannot read", Path::new("/proc/self/cgroup"), e))?;
        let parent = v1_cgroup_in(&text, "blkio")
            .filter(|p| p.join("blkio.throttle.read_bps_device").exists())
            .ok_or_else(|| Error::flag("--read-rate", "--read-rate: no blkio cgroup with blkio.throttle.read_bps_device in /proc/self/cgroup"))?;
        let dir = parent.join(format!("sdq-limit-{}", std::process::id()));
        fs::create_dir(&dir).map_err(|e| Error::io("--read-rate: cannot create", &dir, e))?;
        let cap = ReadCap { dir: Some(dir.clone()), rate, devices };
        for d in &cap.devices {
            let rule = format!("{d} {rate}");
            fs::write(dir.join("blkio.throttle.read_bps_device"), &rule)
                .map_err(|e| Error::io(format!("--read-rate: cannot set blkio.throttle.read_bps_device = {rule} in"), &dir, e))?;
        }
        Ok(cap)
    }

    /// v2: the rules on the memory cgroup `dir` (its io controller enabled
    /// by the parent's cgroup.subtree_control).
    fn set_v2(&self, dir: &Path) -> Result<()> {
        if !dir.join("io.max").exists() {
            return Err(Error::invalid(format!(
                "--read-rate: the io controller is not enabled below {} (its cgroup.subtree_control lacks \"io\")",
                dir.parent().unwrap_or(dir).display()
            )));
        }
        for d in &self.devices {
            let rule = format!("{d} rbps={}", self.rate);
            fs::write(dir.join("io.max"), &rule).map_err(|e| Error::io(format!("--read-rate: cannot set io.max = {rule} in"), dir, e))?;
        }
        Ok(())
    }

    /// Bytes the command read from the capped disks, as the block layer
    /// counted them.
    fn read_bytes(&self, memory: Option<&Cgroup>) -> Option<u64> {
        let on_capped = |dev: &str| self.devices.iter().any(|d| d == dev);
        match &self.dir {
            // "MAJ:MIN Read N" lines
            Some(dir) => Some(
                fs::read_to_string(dir.join("blkio.throttle.io_service_bytes"))
                    .ok()?
                    .lines()
                    .filter_map(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        (f.len() == 3 && f[1] == "Read" && on_capped(f[0])).then(|| f[2].parse::<u64>().ok()).flatten()
                    })
                    .sum(),
            ),
            // "MAJ:MIN rbytes=N wbytes=N ..." lines
            None => Some(
                fs::read_to_string(memory?.dir.join("io.stat"))
                    .ok()?
                    .lines()
                    .filter_map(|l| {
                        let mut f = l.split_whitespace();
                        let dev = f.next()?;
                        on_capped(dev).then(|| f.find_map(|kv| kv.strip_prefix("rbytes=")?.parse::<u64>().ok())).flatten()
                    })
                    .sum(),
            ),
        }
    }
}

impl Drop for ReadCap {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            remove_cgroup(dir);
        }
    }
}

/// "MAJ:MIN" of each whole disk with a device behind it (not loop, ram or
/// zram devices, which have none).
fn whole_disks() -> Vec<String> {
    let Ok(entries) = fs::read_dir("/sys/block") else { return Vec::new() };
    let mut out: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join("device").exists())
        .filter_map(|e| Some(fs::read_to_string(e.path().join("dev")).ok()?.trim().to_string()))
        .collect();
    out.sort();
    out
}
