//! The drop-in llama.cpp tools: each binary runs one upstream tool's entry
//! function with upstream's argv, exit code and signal behaviour.

use crate::options::{self, Options};
use crate::{hooks, runtime};
use std::ffi::{c_char, c_int, CString, OsString};
use std::os::unix::ffi::OsStringExt;

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
    }
}

extern "C" fn print_sdq_help() {
    eprint!("\n{}", options::HELP);
}

extern "C" fn finish_runtime() {
    if let Some(rt) = runtime::get() {
        rt.finish(true);
    }
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
    let opts = match Options::from_args_and_env(&mut args, |k| std::env::var(k).ok()) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{program}: error: {e}");
            std::process::exit(1);
        }
    };
    if args.iter().skip(1).any(|a| a == "-h" || a == "--help" || a == "--usage") {
        // Upstream prints its help and may exit() from inside its parser.
        // SAFETY: registering a plain extern "C" function with no state.
        unsafe { libc::atexit(print_sdq_help) };
    }
    if opts.budget.is_some() {
        // Children (llama-server's router re-executes itself) inherit the options.
        for (k, v) in opts.to_env() {
            std::env::set_var(k, v);
        }
        runtime::install(opts);
        hooks::install();
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
    finish_runtime();
    // exit() runs atexit handlers and flushes stdio, as returning from main does.
    std::process::exit(code)
}
