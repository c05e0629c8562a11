//! `sdq limit` enforces a memory limit with a real cgroup, and
//! `--ram-budget auto` picks that limit up.

use crate::util::*;
use serde_json::Value;
use std::process::Command;

/// Runs `sdq limit --memory LIMIT -- CMD`, returning the exit code and report,
/// or None (with a printed reason) where the report says nothing was enforced.
fn limited(limit: &str, cmd: &[&str]) -> Option<(Option<i32>, Value)> {
    let report = scratch().join(format!("limit-{}.json", std::process::id()));
    let o = run(Command::new(bin("sdq")).args(["limit", "--memory", limit, "--report", report.to_str().unwrap(), "--"]).args(cmd), 300);
    let r: Value = read_json(&report);
    if r["enforced"] != true {
        eprintln!("SKIPPED: no writable memory cgroup here: {}", r["mode"]);
        return None;
    }
    Some((o.status.code(), r))
}

#[test]
fn a_process_over_the_limit_is_oom_killed_and_reported() {
    let Some((code, r)) = limited("64M", &["python3", "-c", "x = bytearray(256 << 20)"]) else { return };
    assert_eq!(code, Some(128 + 9), "{r}");
    assert_eq!(r["signal"], 9);
    assert!(r["oom_kills"].as_u64() >= Some(1), "{r}");
    assert_eq!(r["swap_bytes"], 0);
    assert!(r["peak_bytes"].as_u64() <= Some(64 << 20), "{r}");
}

#[test]
fn a_process_under_the_limit_runs_and_its_peak_is_measured() {
    let Some((code, r)) = limited("256M", &["python3", "-c", "x = bytearray(64 << 20); x[::4096] = b'x' * len(x[::4096])"]) else { return };
    assert_eq!(code, Some(0), "{r}");
    assert_eq!(r["oom_kills"], 0);
    let peak = r["peak_bytes"].as_u64().unwrap();
    assert!((64 << 20..=256 << 20).contains(&peak), "{r}");
    // The runner removed its cgroup.
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    assert!(!cgroups.contains("sdq-limit"), "{cgroups}");
}

#[test]
fn a_read_rate_caps_what_the_command_reads_from_the_disk() {
    // 48 MiB written, then dropped from the page cache: read back with
    // O_DIRECT under a 16 MiB/s cap, it must take three seconds, whatever
    // the disk (or a host's cache of it) could do.
    let file = scratch().join("read-rate.bin");
    std::fs::write(&file, vec![7u8; 48 << 20]).unwrap();
    let f = file.to_str().unwrap();
    let dropped = run(
        Command::new("python3").args([
            "-c",
            "import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)",
            f,
        ]),
        60,
    );
    assert!(dropped.status.success(), "{}", String::from_utf8_lossy(&dropped.stderr));
    let report = scratch().join(format!("read-rate-{}.json", std::process::id()));
    let o = run(
        Command::new(bin("sdq")).args(["limit", "--memory", "1G", "--read-rate", "16M", "--report", report.to_str().unwrap(), "--"]).args([
            "dd",
            &format!("if={f}"),
            "of=/dev/null",
            "bs=1M",
            "iflag=direct",
        ]),
        120,
    );
    let r: Value = read_json(&report);
    if r["enforced"] != true {
        eprintln!("SKIPPED: no writable memory cgroup here: {}", r["mode"]);
        return;
    }
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(r["read_rate_bytes_per_s"], 16 << 20, "{r}");
    assert!(r["disk_read_bytes"].as_u64() >= Some(48 << 20), "{r}");
    let secs = r["seconds"].as_f64().unwrap();
    assert!((2.7..30.0).contains(&secs), "48 MiB at 16 MiB/s took {secs} s: {r}");
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn auto_budget_takes_the_cgroup_limit() {
    let stats = scratch().join("auto-stats.json");
    let _ = std::fs::remove_file(&stats);
    let model = tiny().to_str().unwrap();
    let sdq = bin("sdq");
    let Some((code, r)) =
        limited("1536M", &[sdq.to_str().unwrap(), "eval", "-m", model, "-n", "4", "--ram-budget", "auto", "--sdq-stats", stats.to_str().unwrap()])
    else {
        return;
    };
    assert_eq!(code, Some(0), "{r}");
    let s: Value = read_json(&stats);
    assert_eq!(s["budget_bytes"], 1536u64 << 20, "auto did not pick the cgroup limit: {s}");
}

#[test]
fn a_terminated_runner_still_removes_its_cgroup() {
    let report = scratch().join("limit-term.json");
    let _ = std::fs::remove_file(&report);
    let mut runner = Command::new(bin("sdq")).args(["limit", "--memory", "256M", "--report", report.to_str().unwrap(), "--", "sleep", "30"]).spawn().unwrap();
    // The runner has started the command (its cgroup made) once it has a child.
    child_of(runner.id());
    let started = std::time::Instant::now();
    assert!(Command::new("kill").args(["-TERM", &runner.id().to_string()]).status().unwrap().success());
    let status = runner.wait().unwrap();
    assert!(started.elapsed().as_secs() < 5, "the runner did not stop promptly");
    assert_eq!(status.code(), Some(128 + 15), "{status}");
    let r: Value = read_json(&report);
    if r["enforced"] != true {
        eprintln!("SKIPPED: no writable memory cgroup here: {}", r["mode"]);
        return;
    }
    assert_eq!(r["signal"], 15, "{r}");
    let dir = std::path::Path::new("/sys/fs/cgroup/memory");
    let leftover = std::process::Command::new("find").arg(dir).args(["-maxdepth", "3", "-name", &format!("sdq-limit-{}", runner.id())]).output().unwrap();
    assert!(leftover.stdout.is_empty(), "cgroup left behind: {}", String::from_utf8_lossy(&leftover.stdout));
}

#[test]
fn a_runner_signalled_as_it_starts_leaves_no_cgroup_behind() {
    // SIGTERM at moments from the runner's start to its command's: before
    // its handler is in place it may die of it (then it has made nothing);
    // after, it forwards the signal, once the command runs if need be, and
    // ends as the command did. Either way no cgroup of its stays behind.
    let dir = std::path::Path::new("/sys/fs/cgroup/memory");
    let mut forwarded = 0;
    // Every 250 µs over the first 15 ms (where the runner's start lies on
    // this VM), then a few later moments.
    for delay_us in (0..60).map(|i| i * 250).chain([20_000, 30_000, 50_000, 80_000]) {
        let report = scratch().join(format!("limit-early-{delay_us}.json"));
        let _ = std::fs::remove_file(&report);
        let mut runner =
            Command::new(bin("sdq")).args(["limit", "--memory", "256M", "--report", report.to_str().unwrap(), "--", "sleep", "30"]).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_micros(delay_us));
        let started = std::time::Instant::now();
        assert!(Command::new("kill").args(["-TERM", &runner.id().to_string()]).status().unwrap().success());
        let status = runner.wait().unwrap();
        assert!(started.elapsed().as_secs() < 5, "{delay_us} µs: the runner did not stop promptly");
        if status.code() == Some(128 + 15) {
            let r: Value = read_json(&report);
            assert_eq!(r["signal"], 15, "{delay_us} µs: {r}");
            forwarded += 1;
        } else {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(15), "{delay_us} µs: {status}");
        }
        let leftover = Command::new("find").arg(dir).args(["-maxdepth", "3", "-name", &format!("sdq-limit-{}", runner.id())]).output().unwrap();
        assert!(leftover.stdout.is_empty(), "{delay_us} µs: cgroup left behind: {}", String::from_utf8_lossy(&leftover.stdout));
    }
    assert!(forwarded > 0, "no signal reached a running command");
}

#[test]
fn a_limit_the_process_cannot_meet_is_refused_and_the_old_one_stays() {
    // A process that holds 192 MiB and gives nothing back: lowering its
    // limit to 128 MiB must fail within --wait, naming what it holds, and
    // leave it running under its old limit.
    let report = scratch().join("limit-hold.json");
    let _ = std::fs::remove_file(&report);
    let mut runner = Command::new(bin("sdq"))
        .args(["limit", "--memory", "512M", "--report", report.to_str().unwrap(), "--"])
        .args(["python3", "-c", "import time; x = bytearray(192 << 20); x[::4096] = b'x' * len(x[::4096]); print('ready', flush=True); time.sleep(30)"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(runner.stdout.as_mut().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let pid = child_of(runner.id());
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    if cgroups.contains("sdq-limit-") {
        let o = run(Command::new(bin("sdq")).args(["limit", "--pid", &pid.to_string(), "--memory", "128M", "--wait", "1"]), 60);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("process {pid} still holds")) && err.contains("the old limits stay"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        // Still running, and a limit it fits in is taken.
        assert!(runner.try_wait().unwrap().is_none(), "the process died");
        let o = run(Command::new(bin("sdq")).args(["limit", "--pid", &pid.to_string(), "--memory", "256M", "--wait", "5"]), 60);
        assert!(o.status.success(), "{}", stderr(&o));
    } else {
        eprintln!("SKIPPED: no writable memory cgroup here");
    }
    // No such process: one clear error.
    let o = run(Command::new(bin("sdq")).args(["limit", "--pid", "999999999", "--memory", "1G"]), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("process 999999999"), "{}", stderr(&o));
    let _ = Command::new("kill").arg(pid.to_string()).status();
    let status = runner.wait().unwrap();
    assert!(!status.success());
    let r: Value = read_json(&report);
    assert_eq!(r["oom_kills"], 0, "{r}");
}
