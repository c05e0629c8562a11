//! sdq inside a program that loads `libllama.so` (llama-cpp-python, or any
//! C, C++ or Go program linked with `-lllama`): such a program passes no sdq
//! flags, so the budget and the other options come from the environment
//! (`SDQ_RAM_BUDGET`, `SDQ_STATS_FILE`, …, as the tools read them). Without
//! `SDQ_RAM_BUDGET` nothing is installed and the library is upstream's.
//!
//! `sdq-libllama` (src/bin/sdq-libllama.rs) is that library: the pinned
//! llama.cpp and ggml, whole, with this crate inside, linked as a shared
//! object under upstream's SONAME (build/link.rs).

use crate::engine::runtime::options::Options;
use crate::engine::{hooks, runtime};
use std::sync::atomic::{AtomicBool, Ordering};

/// Installs the pager when the environment asks for a budget; called once,
/// when the library is loaded. A bad setting is reported and leaves the
/// library as upstream's: the host program goes on without a budget.
pub fn init_from_env() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::SeqCst) {
        return;
    }
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_target(false).try_init();
    let opts = match Options::from_args_and_env(&mut vec![std::ffi::OsString::from("libllama")], |k| std::env::var(k).ok()) {
        Ok(o) => o,
        Err(e) => {
            stderr_line!("sdq: error: {e}; libllama runs without a budget");
            return;
        }
    };
    let Some(budget) = opts.budget else { return };
    if let Err(e) = crate::engine::memory::budget::check_against_ram(budget) {
        stderr_line!("sdq: error: {e}; libllama runs without a budget");
        return;
    }
    if let Err(e) = runtime::install(opts) {
        stderr_line!("sdq: error: {e}; libllama runs without a budget");
        return;
    }
    // What would end a tool fails the call instead: the host program goes on.
    runtime::failure::embed();
    hooks::install();
    // The stats file and the summary line when the host program exits.
    // SAFETY: registering a plain extern "C" function with no state.
    unsafe { libc::atexit(crate::host::tools::finish_runtime) };
    log::info!("libllama: routed experts are paged within {}", crate::units::human(budget));
}
