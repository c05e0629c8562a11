//! sdq's own options as a tool's command line and environment carry them:
//! `--ram-budget`, `--sdq-reserve`, `--sdq-stats`, `--sdq-policy`,
//! `--sdq-trace`, `SDQ_FAULT_READ`, sizes,
//! and the server settings the growth plan reads. Input is NUL-separated
//! strings; the first half are arguments, the second environment values.
#![no_main]

use libfuzzer_sys::fuzz_target;

const ENV: &[&str] = &[
    "SDQ_RAM_BUDGET",
    "SDQ_RESERVE_MB",
    "SDQ_STATS_FILE",
    "SDQ_FAULT_READ",
    "SDQ_READERS",
    "SDQ_READ_RETRIES",
    "SDQ_READ_BACKOFF_MS",
    "SDQ_PREFETCH",
    "SDQ_DIRECT_IO",
    "SDQ_POPULATE",
    "SDQ_PRELOAD",
    "SDQ_POLICY",
    "SDQ_TRACE_FILE",
    "LLAMA_ARG_CACHE_RAM",
    "LLAMA_ARG_N_PARALLEL",
];

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let parts: Vec<String> = text.split('\0').map(str::to_string).collect();
    let (args, env) = parts.split_at(parts.len() / 2);
    let lookup = |k: &str| ENV.iter().position(|e| *e == k).and_then(|i| env.get(i).cloned());
    let mut argv: Vec<std::ffi::OsString> = std::iter::once("llama-server".into()).chain(args.iter().map(Into::into)).collect();
    let before = argv.len();
    if let Ok(o) = sdq::engine::runtime::options::Options::from_args_and_env(&mut argv, lookup) {
        assert!(argv.len() <= before);
        let _ = o.to_env();
        if let Some(b) = o.budget {
            let reserve = o.reserve.unwrap_or_else(|| sdq::engine::memory::budget::default_reserve(b));
            let argv: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into_owned()).collect();
            if let Ok(s) = sdq::engine::memory::growth::ToolSettings::from_args_and_env(&argv, &lookup) {
                if let Ok(p) = sdq::engine::memory::growth::plan(&s, reserve, u32::MAX as u64) {
                    assert!(p.reserve >= reserve);
                }
            }
        }
    }
    for p in &parts {
        if let Ok(n) = sdq::units::parse_size(p) {
            let _ = sdq::units::human(n);
        }
        let _ = sdq::engine::pager::io::FaultPlan::parse(p);
    }
});
