//! Shared helpers: the built binaries, generated models, processes with
//! timeouts, and a minimal HTTP client for loopback servers.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Path of one of this package's binaries.
pub fn bin(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_sdq")).parent().unwrap().to_path_buf();
    let p = dir.join(name);
    assert!(p.is_file(), "binary {} not built", p.display());
    p
}

/// A scratch directory for this test binary's files.
pub fn scratch() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sdq-it");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Generates a model with `sdq gen-model ARGS -o scratch/NAME` (once per run).
pub fn gen_model(name: &str, args: &[&str]) -> PathBuf {
    let out = scratch().join(name);
    let o = run(Command::new(bin("sdq")).arg("gen-model").args(args).arg("-o").arg(&out), 600);
    assert!(o.status.success(), "gen-model {args:?} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// A generated model that one test uses and deletes when it ends: the large
/// ones (GBs) would otherwise stay in the scratch directory for the whole run
/// and keep a small CI disk full.
pub struct TempModel(PathBuf);

impl TempModel {
    pub fn generate(name: &str, args: &[&str]) -> TempModel {
        TempModel(gen_model(name, args))
    }

    /// A file written otherwise (a part of a split model), deleted at drop.
    pub fn adopt(path: PathBuf) -> TempModel {
        TempModel(path)
    }
}

impl std::ops::Deref for TempModel {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A 32,000-token vocabulary (llama's SentencePiece tokenizer, which the
/// pinned tree ships in models/) for test models whose tests are about the
/// pager rather than the tokenizer. Loading the preset's 151,936 Qwen3.5
/// tokens and computing their logits at every step took two thirds of a
/// tiny model's run: 0.97 s against 0.30 s for 48 tokens, and the suite
/// runs such a model hundreds of times.
pub const SMALL_VOCAB: [&str; 4] =
    ["--vocab", "32000", "--vocab-file", concat!(env!("CARGO_MANIFEST_DIR"), "/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf")];

/// `sdq gen-model` options `args` with SMALL_VOCAB after them.
pub fn small_vocab<'a>(args: &[&'a str]) -> Vec<&'a str> {
    [args, &SMALL_VOCAB].concat()
}

/// The `tiny` preset model with SMALL_VOCAB, generated once per test run
/// (genmodel.rs checks the preset as it is).
pub fn tiny() -> &'static Path {
    static TINY: OnceLock<PathBuf> = OnceLock::new();
    TINY.get_or_init(|| gen_model("tiny.gguf", &small_vocab(&["--preset", "tiny", "--seed", "1"])))
}

/// The `tiny` preset as a user gets it: Qwen3.5's vocabulary and chat
/// template. For tests about text as well as tokens: programs that
/// detokenize on their own (SentencePiece's byte tokens make partial UTF-8
/// characters, which each program renders its own way), chat, and n-gram
/// drafting, which needs the answers' loops this vocabulary gives.
pub fn tiny_preset() -> &'static Path {
    static TINY: OnceLock<PathBuf> = OnceLock::new();
    TINY.get_or_init(|| gen_model("tiny-preset.gguf", &["--preset", "tiny", "--seed", "1"]))
}

/// The tiny geometry with 256 experts, top-8 (the target's routing width):
/// 308 MB, experts 80 % of it.
pub fn wide() -> &'static Path {
    static WIDE: OnceLock<PathBuf> = OnceLock::new();
    WIDE.get_or_init(|| gen_model("wide.gguf", &["--preset", "tiny", "--experts", "256", "--top-k", "8", "--seed", "3"]))
}

/// Runs `cmd` with stdin from /dev/null, killing it after `timeout_s`.
pub fn run(cmd: &mut Command, timeout_s: u64) -> Output {
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    wait_with_timeout(child, timeout_s)
}

/// Calls `poll` every 50 ms until it gives a value, for at most `secs`:
/// every test that waits for another process waits for a condition this
/// way, never for a fixed time. None when time ran out; the caller's panic
/// says what did not happen.
/// Interrupts llama-server `pid` (SIGINT, its clean shutdown) until `exited`
/// says it has: once, then, after 15 s, a second time (upstream's "hit
/// Ctrl+C twice", for its own signal handler, which takes the task queue's
/// lock and can wait forever on a thread the signal interrupted while it
/// held it; seen once in CI, 2026-12-05), with a line saying so. None if
/// it has not exited 15 s after that.
pub fn interrupt_until_exit<T>(pid: u32, mut exited: impl FnMut() -> Option<T>) -> Option<T> {
    for (i, wait) in [15, 15].into_iter().enumerate() {
        if i > 0 {
            eprintln!("llama-server {pid} did not exit 15 s after SIGINT: interrupting it again");
        }
        // SAFETY: signalling a server this test started (alive: not reaped).
        unsafe { libc::kill(pid as i32, libc::SIGINT) };
        if let Some(v) = poll_until(wait, &mut exited) {
            return Some(v);
        }
    }
    None
}

/// `poll`'s first `Some` within `secs` (asked every 50 ms), or None.
pub fn poll_until<T>(secs: u64, mut poll: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = poll() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `poll`'s first `Some` within `secs`; panics naming `what` otherwise.
pub fn wait_until<T>(what: &str, secs: u64, poll: impl FnMut() -> Option<T>) -> T {
    poll_until(secs, poll).unwrap_or_else(|| panic!("{what}: not within {secs} s"))
}

/// The JSON file at `path` (a stats file, a limit report), read whole.
pub fn read_json(path: impl AsRef<Path>) -> serde_json::Value {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}\n{text}", path.display()))
}

/// Waits for `child` and collects its output, killing it after `timeout_s`.
pub fn wait_with_timeout(child: Child, timeout_s: u64) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(timeout_s)) {
        Ok(o) => o.unwrap(),
        Err(_) => {
            // The child moved into the waiting thread; kill it by pid.
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("process {pid} did not finish within {timeout_s} s");
        }
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Greedy, deterministic llama-completion arguments for `model`.
pub fn completion_args(model: &Path, prompt: &str, n: u32) -> Vec<String> {
    ["-m", model.to_str().unwrap(), "-p", prompt, "-n", &n.to_string(), "--top-k", "1", "-no-cnv", "-t", "2", "-c", "512", "--seed", "1", "--no-warmup"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// A port free on 127.0.0.1 right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child process killed when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 request to 127.0.0.1:`port`; returns (status, body).
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp).into_owned();
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// Starts llama-server on a free loopback port with `args` and waits until /health is 200.
pub fn start_server(args: &[&str]) -> (KillOnDrop, u16) {
    start_server_env(args, &[])
}

/// As `start_server`, with extra environment variables.
pub fn start_server_env(args: &[&str], env: &[(&str, &str)]) -> (KillOnDrop, u16) {
    start_server_logged(args, env, None)
}

/// As `start_server_env`, with the server's stderr written to `log`.
pub fn start_server_logged(args: &[&str], env: &[(&str, &str)], log: Option<&Path>) -> (KillOnDrop, u16) {
    let port = free_port();
    let stderr = log.map_or_else(Stdio::null, |p| Stdio::from(std::fs::File::create(p).unwrap()));
    let child = Command::new(bin("llama-server"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut server = KillOnDrop(child);
    wait_healthy(port, &mut server.0, log, 120);
    (server, port)
}

/// Waits until llama-server on `port` answers /health with 200 (within
/// `secs`); panics, with the server's `log`, if `process` (the server, or
/// what runs it) exits first.
fn wait_healthy(port: u16, process: &mut Child, log: Option<&Path>, secs: u64) {
    wait_until("llama-server healthy", secs, || {
        if let Ok(Some(status)) = process.try_wait() {
            panic!("llama-server exited early: {status}\n{}", log.and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default());
        }
        matches!(http(port, "GET", "/health", None), Ok((200, _))).then_some(())
    });
}

/// Waits until llama-server on `port` is answering a request (one of its
/// slots is processing) or `done` says the requests are over, within 60 s.
pub fn wait_processing(port: u16, done: impl Fn() -> bool) {
    let processing = || http(port, "GET", "/slots", None).is_ok_and(|(status, body)| status == 200 && body.contains("\"is_processing\":true"));
    wait_until("llama-server answering a request", 60, || (done() || processing()).then_some(()));
}

/// The first child of process `pid` (a runner's command), once it has one
/// (within 10 s).
pub fn child_of(pid: u32) -> u32 {
    wait_until(&format!("process {pid} starting its command"), 10, || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?.split_whitespace().next()?.parse().ok()
    })
}

/// `v[key]` as a number (panics naming what is missing).
/// What a run counted as held when it planned its arena: its anonymous
/// memory after load and the compute buffers not yet touched then.
pub fn held_after_load(stats: &serde_json::Value) -> u64 {
    u(stats, "rss_anon_after_load_bytes") + stats["compute_untouched_bytes"].as_u64().unwrap_or(0)
}

pub fn u(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The arena slot of a stats file's slot class: its expert in whole 4 KiB pages.
pub fn slot_bytes(class: &serde_json::Value) -> u64 {
    u(class, "expert_bytes").div_ceil(4096) * 4096
}

/// The tightest arena a run's stats allow: one layer's top-k in each slot class.
pub fn min_arena(stats: &serde_json::Value) -> u64 {
    stats["slot_classes"].as_array().unwrap().iter().map(|c| slot_bytes(c) * u(stats, "top_k")).sum()
}

/// The arena that holds every expert (`experts` per layer) of every paged layer.
pub fn all_arena(stats: &serde_json::Value, experts: u64) -> u64 {
    stats["slot_classes"].as_array().unwrap().iter().map(|c| slot_bytes(c) * experts * u(c, "layers")).sum()
}

/// A budget that leaves `tool` (run with `args`) an arena of one layer's
/// top-k experts plus `extra` bytes over a 16 MiB reserve, from a probe run
/// that reports what the process holds after load (the resident weights are
/// read into memory under a budget, so this is most of the budget).
pub fn tight_budget(tool: &str, args: &[&str], env: &[(&str, &str)], extra: u64) -> String {
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let stats = scratch().join(format!("probe-{}.json", PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let o = run(
        Command::new(bin(tool))
            .args(args)
            .args(["--ram-budget", "2G", "--sdq-reserve", "16M", "--sdq-stats", stats.to_str().unwrap()])
            .envs(env.iter().copied()),
        300,
    );
    assert!(o.status.success(), "probe {tool} {args:?}: {}", stderr(&o));
    let s = read_json(&stats);
    let min = min_arena(&s);
    // 1 MiB more: anonymous RSS after load varies a little between runs.
    (held_after_load(&s) + 16 * (1 << 20) + min + (1 << 20) + extra).to_string()
}

/// Stock's plain CPU path: no repacked weights (`--no-repack`) and no tiled
/// K-quant kernel, which stock (and the pager, bit for bit) takes per expert
/// once 8 or more rows of a batch reach it.
pub const PLAIN: (&str, &str) = ("GGML_CPU_TILED_MM", "0");

/// True when the suite runs under scripts/sanitize (AddressSanitizer).
pub fn sanitized() -> bool {
    std::env::var_os("SDQ_TEST_SANITIZED").is_some()
}

/// `mib` MiB as a budget string, plus, under AddressSanitizer, the 128 MiB of
/// shadow memory and quarantine it adds to a process (scripts/sanitize caps
/// the quarantine), which no budget written for the plain build allows for.
pub fn budget_mib(mib: u64) -> String {
    ((mib + if sanitized() { 128 } else { 0 }) << 20).to_string()
}

/// llama-server run by `sdq limit --memory LIMIT` (a memory cgroup, no
/// swap). Dropped: the server is killed and the runner reaped.
pub struct LimitedServer {
    runner: Child,
    /// The server's pid (the runner's child).
    pub pid: u32,
    pub port: u16,
    /// The runner's report (peak, OOM kills, swap), written when it exits.
    pub report: PathBuf,
}

impl LimitedServer {
    /// Stops the server with SIGINT (its clean shutdown) and returns the runner's report.
    pub fn stop(mut self) -> serde_json::Value {
        interrupt_until_exit(self.pid, || self.runner.try_wait().unwrap()).expect("llama-server stops within 30 s of SIGINT");
        read_json(&self.report)
    }
}

impl Drop for LimitedServer {
    fn drop(&mut self) {
        if self.runner.try_wait().ok().flatten().is_none() {
            // SAFETY: as in stop(); the runner then exits and removes its cgroup.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
            let _ = self.runner.wait();
        }
    }
}

/// Starts llama-server with `args` inside `sdq limit --memory LIMIT` and
/// waits until /health is 200; None (with a printed reason) where no
/// memory cgroup can be made here.
pub fn start_server_limited(limit: &str, args: &[&str], env: &[(&str, &str)], log: &Path) -> Option<LimitedServer> {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let port = free_port();
    let report = scratch().join(format!("limit-server-{}.json", RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let _ = std::fs::remove_file(&report);
    let runner = Command::new(bin("sdq"))
        .args(["limit", "--memory", limit, "--report", report.to_str().unwrap(), "--"])
        .arg(bin("llama-server"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()))
        .spawn()
        .unwrap();
    let pid = child_of(runner.id());
    let mut server = LimitedServer { runner, pid, port, report };
    wait_healthy(port, &mut server.runner, Some(log), 120);
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    if !cgroups.contains("sdq-limit-") {
        eprintln!("SKIPPED: no writable memory cgroup here (the server runs unconfined)");
        return None;
    }
    Some(server)
}

/// `sdq limit --pid PID --memory LIMIT`: changes a running process's limit;
/// returns its report.
pub fn set_limit(pid: u32, limit: u64) -> serde_json::Value {
    let report = scratch().join(format!("set-limit-{pid}.json"));
    let o = run(Command::new(bin("sdq")).args(["limit", "--pid", &pid.to_string(), "--memory", &limit.to_string(), "--report", report.to_str().unwrap()]), 60);
    assert!(o.status.success(), "sdq limit --pid {pid} --memory {limit}: {}", stderr(&o));
    read_json(&report)
}

/// Anonymous RSS of process `pid`.
pub fn rss_anon_of(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find_map(|l| l.strip_prefix("RssAnon:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).unwrap() * 1024
}

/// The stats file once `cond` holds for it (it is rewritten every second),
/// within `secs`; panics with the last one otherwise.
pub fn stats_when(path: &Path, secs: u64, what: &str, cond: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let read = || std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    poll_until(secs, || read().filter(|s| cond(s))).unwrap_or_else(|| match read() {
        Some(s) => panic!("{what}: not within {secs} s: {s}"),
        None => panic!("{what}: no stats file {} within {secs} s", path.display()),
    })
}

/// The generator of the tests' made-up texts (Knuth's MMIX LCG): the
/// next state from `x`.
fn next_state(x: u64) -> u64 {
    x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407)
}

/// `n` made-up words of 2 to 7 letters from `seed`: a prompt that is not a
/// few tokens repeated (about 2.5 tokens a word).
pub fn made_up_words(n: usize, seed: u64) -> String {
    let mut x = seed;
    let words: Vec<String> = (0..n)
        .map(|_| {
            (0..2 + x % 6)
                .map(|_| {
                    x = next_state(x);
                    (b'a' + (x >> 33) as u8 % 26) as char
                })
                .collect()
        })
        .collect();
    words.join(" ")
}

/// `n` words drawn from eight common ones by `seed`: a long prompt of
/// about one token a word.
pub fn common_words(n: usize, seed: u64) -> String {
    let mut x = seed;
    let words: Vec<&str> = (0..n)
        .map(|_| {
            x = next_state(x);
            ["the", "red", "sea", "old", "town", "light", "stone", "river"][(x >> 40) as usize % 8]
        })
        .collect();
    words.join(" ")
}
