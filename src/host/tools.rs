//! The drop-in llama.cpp tools: each binary runs one upstream tool's entry
//! function with upstream's argv, exit code and signal behaviour.

use crate::engine::hooks;
use crate::engine::memory::growth;
use crate::engine::runtime::options::{self, Options};
use crate::engine::runtime::{self, batching, preflight};
use std::ffi::{c_char, c_int, CString, OsString};
use std::os::unix::ffi::OsStringExt;

/// sdq's version and the pinned llama.cpp commit, as `--version` prints them.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (llama.cpp ", env!("SDQ_LLAMA_COMMIT"), ")");

/// An upstream tool's entry function, `int llama_x(int argc, char ** argv)`, behind its C shim.
pub type Entry = unsafe extern "C" fn(c_int, *mut *mut c_char) -> c_int;

/// The C shims (shim/tools/*.cpp): each calls one tool's upstream entry
/// function inside try/catch. Only declared here, so a binary links just the
/// tool it names.
pub mod entry {
    use std::ffi::{c_char, c_int};
    extern "C" {
        pub fn sdq_tool_cli(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_completion(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_server(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_bench(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_perplexity(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_quantize(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_batched_bench(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_gguf_split(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_imatrix(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_tokenize(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_mtmd_cli(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_test_llama_archs(argc: c_int, argv: *mut *mut c_char) -> c_int;
        pub fn sdq_tool_rpc_server(argc: c_int, argv: *mut *mut c_char) -> c_int;
    }
}

extern "C" fn print_sdq_help() {
    eprint!("\n{}", options::HELP);
}

/// At exit: the stats file and the summary line (also for a host program of
/// sdq's libllama, src/host/library.rs).
pub(crate) extern "C" fn finish_runtime() {
    finish_runtime_checked();
}

/// Finishes the runtime; false if the budget was not honoured (see `Runtime::finish`).
fn finish_runtime_checked() -> bool {
    runtime::get().map_or(true, |rt| rt.finish(true))
}

/// The models named by `-m`/`--model` (or `LLAMA_ARG_MODEL`); llama-bench
/// also takes a comma-separated list.
fn model_paths(args: &[OsString]) -> Vec<std::path::PathBuf> {
    let mut values: Vec<String> = Vec::new();
    let mut it = args.iter().skip(1).map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = it.next() {
        if a == "-m" || a == "--model" {
            values.extend(it.next());
        } else if let Some(v) = a.strip_prefix("--model=") {
            values.push(v.to_string());
        }
    }
    if values.is_empty() {
        values.extend(std::env::var("LLAMA_ARG_MODEL").ok().filter(|v| !v.is_empty()));
    }
    values
        .into_iter()
        .flat_map(|v| {
            if v.contains(',') && !std::path::Path::new(&v).exists() {
                v.split(',').map(std::path::PathBuf::from).collect::<Vec<_>>()
            } else {
                vec![std::path::PathBuf::from(v)]
            }
        })
        .collect()
}

/// Checks each model the tool is about to load under a budget, exiting with
/// a one-line error if one is unusable. Tools that name no model file
/// (downloads, a server's model directory) get no checks.
fn check_models(program: &str, args: &[OsString]) -> Vec<preflight::ModelCheck> {
    model_paths(args)
        .iter()
        .map(|p| {
            preflight::check_model(p).unwrap_or_else(|e| {
                stderr_line!("{program}: error: {e}");
                std::process::exit(1);
            })
        })
        .collect()
}

/// The draft model the tool will load after its target (`-md`), if it has
/// routed experts and is another file: its experts are paged beside the
/// target's. Checked as the target is; exits with the error if unusable.
fn draft_with_experts(program: &str, args: &[String], targets: &[preflight::ModelCheck]) -> Option<std::path::PathBuf> {
    let path = std::path::PathBuf::from(growth::draft_model(args, &|k| std::env::var(k).ok())?);
    if targets.iter().any(|t| t.files.first() == Some(&path)) {
        return None;
    }
    let check = preflight::check_model(&path).unwrap_or_else(|e| {
        stderr_line!("{program}: error: {e}");
        std::process::exit(1);
    });
    (check.routed_expert_tensors > 0).then_some(path)
}

/// Fits the tool's growth after load (prompt cache, context checkpoints) into
/// the reserve: sets upstream's variables for what the user left alone and
/// raises the reserve for what they asked for (see `growth`).
fn fit_growth(program: &str, args: &[String], checkpoint: u64, budget: u64, opts: &mut Options) {
    let fail = |e: crate::error::Error| -> ! {
        stderr_line!("{program}: error: {e}");
        std::process::exit(1);
    };
    let settings = growth::ToolSettings::from_args_and_env(args, &|k| std::env::var(k).ok()).unwrap_or_else(|e| fail(e));
    let reserve = opts.reserve.unwrap_or_else(|| crate::engine::memory::budget::default_reserve(budget));
    let plan = growth::plan(&settings, reserve, checkpoint).unwrap_or_else(|e| fail(e));
    for (k, v) in &plan.env {
        std::env::set_var(k, v);
    }
    if let Some(n) = &plan.notice {
        stderr_line!("sdq: notice: {n}");
    }
    if plan.reserve != reserve {
        opts.reserve = Some(plan.reserve);
    }
    opts.planned_growth = plan.bytes;
}

/// llama-completion and llama-cli get a prompt as large as the context in
/// one `llama_decode`, which reads its experts once, where the user left
/// `-b` alone and it changes no ubatch; llama-server gets it for a prompt
/// alone in its batch (see `batching`). Set as `LLAMA_ARG_BATCH`, which
/// llama.cpp's parser reads only for a flag the command line does not give.
fn whole_prompt_batch(program: &str, args: &[String], checks: &[preflight::ModelCheck]) {
    let flags = batching::BatchFlags::from_args_and_env(args, &|k| std::env::var(k).ok()).unwrap_or_else(|e| {
        stderr_line!("{program}: error: {e}");
        std::process::exit(1);
    });
    if tool_is(program, "llama-server") {
        // Only a server of a named model: a router's children (one per
        // model) decide for themselves, and would take an inherited
        // variable for the user's.
        let Some(check) = checks.first() else { return };
        if let Some(batch) = flags.lone_prompt_batch(check.trained_context) {
            log::info!("-b {batch}: a prompt alone in its batch is one batch up to the context, its experts read once; beside other requests' tokens a batch holds stock's {}", batching::STOCK_BATCH);
            std::env::set_var("LLAMA_ARG_BATCH", batch.to_string());
            batching::raise_server_batch();
        }
    } else if let Some(batch) = flags.whole_prompt_batch() {
        log::info!("-b {batch}: a prompt up to the context is one batch, its experts read once (the ubatches are stock's)");
        std::env::set_var("LLAMA_ARG_BATCH", batch.to_string());
    }
}

/// True if `program` is the tool `tool` (also under a suffixed name).
fn tool_is(program: &str, tool: &str) -> bool {
    std::path::Path::new(program).file_name().is_some_and(|n| n.to_string_lossy().starts_with(tool))
}

/// llama-server and llama-cli keep a prompt cache and checkpoints; the other
/// tools ignore the variables.
fn tool_has_prompt_cache(program: &str) -> bool {
    tool_is(program, "llama-server") || tool_is(program, "llama-cli")
}

/// rpc-server's `-m FILE`: the node's own copy of the model, whose routed
/// experts it pages for the layers a host places on it. Upstream's
/// rpc-server has no such flag, so it is taken out of `args`.
fn take_node_model(args: &mut Vec<OsString>) -> Option<std::path::PathBuf> {
    let i = args.iter().skip(1).position(|a| a == "-m" || a == "--model")? + 1;
    let path = args.get(i + 1).map(std::path::PathBuf::from);
    args.drain(i..(i + 2).min(args.len()));
    path
}

/// A signal that stops rpc-server (it serves until stopped), for the
/// watcher in `finish_on_stop_signal`.
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn note_stop_signal(sig: c_int) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// rpc-server ends on SIGINT or SIGTERM: the stats file and the summary
/// line are written first, then the signal ends it as it would upstream's.
fn finish_on_stop_signal() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, note_stop_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, note_stop_signal as *const () as libc::sighandler_t);
    }
    std::thread::Builder::new()
        .name("sdq-stop".into())
        .spawn(|| loop {
            let sig = STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst);
            if sig != 0 {
                finish_runtime();
                // SAFETY: restoring the default disposition and raising the
                // signal ends the process as the signal would have.
                unsafe {
                    libc::signal(sig, libc::SIG_DFL);
                    libc::raise(sig);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        })
        .expect("spawn the stop-signal watcher");
}

/// Runs the tool behind `entry` with this process's arguments and exits with
/// its status, as the upstream `main` would. sdq's own options are taken out
/// first; with a RAM budget, routed experts are paged.
pub fn run(entry: Entry) -> ! {
    // Rust starts with SIGPIPE ignored; upstream's C++ tools die on it (`| head`).
    // SAFETY: restoring the default disposition of a signal before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).format_target(false).init();
    let program = std::env::args_os().next().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let mut opts = match Options::from_args_and_env(&mut args, |k| std::env::var(k).ok()) {
        Ok(o) => o,
        Err(e) => {
            stderr_line!("{program}: error: {e}");
            std::process::exit(1);
        }
    };
    if args.iter().skip(1).any(|a| a == "--version") {
        // Upstream's own version lines follow (its build number and commit).
        stderr_line!("sdq {VERSION}");
    }
    if args.iter().skip(1).any(|a| a == "-h" || a == "--help" || a == "--usage") {
        // Upstream prints its help and may exit() from inside its parser.
        // SAFETY: registering a plain extern "C" function with no state.
        unsafe { libc::atexit(print_sdq_help) };
    }
    if let Err(e) = opts.check_needs_budget() {
        stderr_line!("{program}: error: {e}");
        std::process::exit(1);
    }
    if let Some(Err(e)) = opts.budget.map(crate::engine::memory::budget::check_against_ram) {
        stderr_line!("{program}: error: {e}");
        std::process::exit(1);
    }
    let checks = if opts.budget.is_some() { check_models(&program, &args) } else { Vec::new() };
    let node_model = if tool_is(&program, "rpc-server") { take_node_model(&mut args) } else { None };
    if tool_is(&program, "rpc-server") && opts.budget.is_some() && node_model.is_none() {
        stderr_line!("{program}: error: --ram-budget on an rpc-server pages the routed experts of its own copy of the model: name it with -m FILE (the same model files as the host's)");
        std::process::exit(1);
    }
    if node_model.is_some() && opts.budget.is_none() {
        stderr_line!("sdq: notice: -m is used with --ram-budget only; rpc-server runs as upstream's and the host sends every weight");
    }
    // Models were named and none has routed experts: there is nothing to page.
    if !checks.is_empty() && checks.iter().all(|c| c.routed_expert_tensors == 0) {
        let tool = std::path::Path::new(&program).file_name().map_or(program.clone(), |n| n.to_string_lossy().into_owned());
        stderr_line!("sdq: notice: the model has no routed-expert tensors; --ram-budget is ignored and {tool} runs as stock llama.cpp");
    } else if let Some(budget) = opts.budget {
        if tool_is(&program, "llama-imatrix") {
            // It reads each expert matmul's input from the graph (patch 0003
            // shows it sdq's paged matmul as MUL_MAT_ID); the fused layer op
            // would hide the down projection's input.
            hooks::use_per_matmul_experts();
        }
        if tool_is(&program, "llama-server") {
            // It answers a batch whose expert read failed with the error and
            // goes on (patch 0004); every other tool ends with the error.
            runtime::failure::allow_batch_abort();
        }
        // The flags as text, for the readers of upstream's flags below.
        let text: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        if tool_has_prompt_cache(&program) {
            let checkpoint = checks.first().map_or(0, |c| c.checkpoint_bytes);
            fit_growth(&program, &text, checkpoint, budget, &mut opts);
        }
        if tool_is(&program, "llama-completion") || tool_is(&program, "llama-cli") || tool_is(&program, "llama-server") {
            whole_prompt_batch(&program, &text, &checks);
        }
        let draft = draft_with_experts(&program, &text, &checks);
        if draft.is_some() && opts.trace_file.is_some() {
            stderr_line!("{program}: error: --sdq-trace records one model's routing, and the draft model has routed experts too: trace without -md");
            std::process::exit(1);
        }
        // Children (llama-server's router re-executes itself) inherit the options.
        for (k, v) in opts.to_env() {
            std::env::set_var(k, v);
        }
        if let Err(e) = runtime::install(opts) {
            stderr_line!("{program}: error: {e}");
            std::process::exit(1);
        }
        if let (Some(rt), Some(draft)) = (runtime::get(), draft) {
            rt.await_model(draft);
        }
        hooks::install();
        if let Some(path) = &node_model {
            // A node's failed read, or a budget too small for its arena,
            // fails the host's batch; the node serves on.
            runtime::failure::serve_as_node();
            if let Err(e) = crate::engine::rpc::node::open(path) {
                stderr_line!("{program}: error: {e}");
                std::process::exit(1);
            }
            finish_on_stop_signal();
        }
        // Tools may exit() without returning; the stats are written either way.
        // SAFETY: registering a plain extern "C" function with no state.
        unsafe { libc::atexit(finish_runtime) };
    }
    let args: Vec<CString> = args
        .into_iter()
        .map(|a| {
            let mut bytes = a.into_vec();
            bytes.retain(|&b| b != 0); // argv strings from the OS never hold NUL
            CString::new(bytes).expect("NUL removed")
        })
        .collect();
    let mut argv: Vec<*mut c_char> = args.iter().map(|a| a.as_ptr() as *mut c_char).collect();
    let argc = c_int::try_from(args.len()).expect("argument count fits in int");
    argv.push(std::ptr::null_mut());
    // SAFETY: argv is a NULL-terminated array of argc valid C strings that
    // outlive the call (`args` lives until exit); the shim catches C++
    // exceptions, so nothing unwinds into Rust.
    let code = unsafe { entry(argc, argv.as_mut_ptr()) };
    let honoured = finish_runtime_checked();
    let code = if code == 0 && !honoured { 1 } else { code };
    // exit() runs atexit handlers and flushes stdio, as returning from main does.
    std::process::exit(code)
}
