//! How an error leaves sdq when nothing can be returned (inside ggml's
//! callbacks and the loader's hooks): a tool ends with the error; a batch is
//! abandoned where the tool goes on without it (llama-server, a host
//! program); a load fails inside a host program. Also `guard`, which keeps a
//! panic from unwinding into C or C++.

use super::get;
use crate::engine::ffi::unwind;
use crate::engine::ffi::unwind::{catch, Failure};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

/// Ends the process at once with `msg` on stderr (and the stats file, if
/// asked for). For errors inside ggml's callbacks, where nothing can be
/// returned: no token is produced after this.
pub fn fatal(msg: &str) -> ! {
    // Inside a host program the process is not sdq's to end: the error
    // unwinds to the guard of the call from C or C++ it happened in, which
    // fails that call (a load, a batch) and returns.
    if embedded() && unwind::in_catch() {
        unwind::raise_fatal(msg);
    }
    // ggml's threads compute the same node: each may meet the same error
    // (a budget too small, seen by every thread of the first paged layer).
    // The first says it and ends the process; another waits for that end,
    // and ends it itself should the first not get there.
    static ENDING: OnceLock<std::thread::ThreadId> = OnceLock::new();
    let me = std::thread::current().id();
    if ENDING.set(me).is_err() {
        if ENDING.get() != Some(&me) {
            std::thread::sleep(std::time::Duration::from_secs(10));
        }
        // SAFETY: as below.
        unsafe { libc::_exit(1) }
    }
    stderr_line!("sdq: error: {msg}");
    if let Some(rt) = get() {
        rt.finish(false);
    }
    // SAFETY: _exit ends the process without running atexit handlers or
    // destructors, which other threads (ggml's workers) may still be using.
    unsafe { libc::_exit(1) }
}

/// A batch abandoned because an expert read failed. llama-server goes on
/// without the batch: every context asks sdq's abort callback after each
/// node (patch 0011), and the server answers the batch's requests with the
/// error. A host program of sdq's libllama sees llama_decode fail. Every
/// other tool ends on a failed read (llama-cli shares the server's code, and
/// the callback, but is told not to go on).
struct BatchAbort {
    /// The tool abandons a batch rather than end (`allow_batch_abort`).
    supported: AtomicBool,
    /// `IDLE`, `REQUESTED` (ggml has yet to be told to stop the graph) or
    /// `STOPPING` (told: the graph ends at this node; failures of its other
    /// threads in the same node are the same batch's).
    state: AtomicU8,
    /// The first error of the abandoned batch, until the tool takes it.
    error: Mutex<Option<String>>,
}

const IDLE: u8 = 0;
const REQUESTED: u8 = 1;
const STOPPING: u8 = 2;

static BATCH_ABORT: BatchAbort = BatchAbort { supported: AtomicBool::new(false), state: AtomicU8::new(IDLE), error: Mutex::new(None) };

/// What failed in this process so far: the exit line says it.
#[derive(Clone, Debug, Default)]
pub struct Failed {
    /// Batches abandoned (a failed read, a budget too small, a panic).
    pub batches: u64,
    /// Model loads and context creations that failed (inside a host program).
    pub loads: u64,
    /// The first failure's message.
    pub first: Option<String>,
}

static FAILED: Mutex<Failed> = Mutex::new(Failed { batches: 0, loads: 0, first: None });

fn record(load: bool, msg: &str) {
    let mut f = FAILED.lock().unwrap_or_else(|p| p.into_inner());
    if load {
        f.loads += 1;
    } else {
        f.batches += 1;
    }
    f.first.get_or_insert_with(|| msg.to_string());
}

/// What failed so far.
pub fn failed() -> Failed {
    FAILED.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// An expert the batch needs could not be read: the batch is abandoned where
/// the tool can do that (its outputs are never used: ggml stops the graph
/// after the current node and the tool drops the batch), else the process
/// ends with the error.
pub fn fail_batch(msg: &str) {
    if !BATCH_ABORT.supported.load(Ordering::Acquire) {
        fatal(msg);
    }
    let mut first = BATCH_ABORT.error.lock().unwrap_or_else(|p| p.into_inner());
    // Said once per abandoned batch (its other threads may fail too, also
    // after ggml was told to stop, while they finish the node).
    if BATCH_ABORT.state.compare_exchange(IDLE, REQUESTED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        say_error(&format!("sdq: error: {msg}; the batch is abandoned"));
        record(false, msg);
    }
    if first.is_none() {
        *first = Some(msg.to_string());
    }
}

/// A batch failed on an RPC node (its graph stopped there, with `msg`):
/// abandoned as for a read failed here, except that this process's graph
/// has already stopped, so ggml is not asked to stop it.
pub fn fail_batch_elsewhere(msg: &str) {
    if !BATCH_ABORT.supported.load(Ordering::Acquire) {
        fatal(msg);
    }
    let mut first = BATCH_ABORT.error.lock().unwrap_or_else(|p| p.into_inner());
    if first.is_none() {
        say_error(&format!("sdq: error: {msg}; the batch is abandoned"));
        record(false, msg);
        *first = Some(msg.to_string());
    }
}

/// sdq runs inside a host program (src/host/library.rs): what would end a tool
/// fails the batch instead (llama_decode returns non-zero), and the host
/// goes on.
static EMBEDDED: AtomicBool = AtomicBool::new(false);

/// The error that fails the model load in progress (inside a host program).
static LOAD_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// A file or weight sdq cannot page: inside a host program the model load
/// fails (the loader throws the error: llama_model_load_from_file returns
/// NULL) and the program goes on; a tool ends with the error.
pub fn fail_load(msg: &str) {
    if !EMBEDDED.load(Ordering::Acquire) {
        fatal(msg);
    }
    let mut e = LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    if e.is_none() {
        say_error(&format!("sdq: error: {msg}"));
        record(true, msg);
        *e = Some(msg.to_string());
    }
}

/// The error that fails the model load in progress, once.
pub fn take_load_error() -> Option<String> {
    LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// An error line on stderr; inside a host program also in the program's own
/// llama.cpp log callback, if it set one (`llama::log_error`).
fn say_error(line: &str) {
    if EMBEDDED.load(Ordering::Acquire) {
        crate::engine::ffi::llama::log_error(line);
    } else {
        stderr_line!("{line}");
    }
}

/// True inside a host program that loaded sdq's libllama (`embed`).
pub fn embedded() -> bool {
    EMBEDDED.load(Ordering::Acquire)
}

/// True from a batch's failure until ggml has stopped its graph.
pub fn batch_abandoned() -> bool {
    BATCH_ABORT.state.load(Ordering::Acquire) != IDLE
}

/// sdq runs in an rpc-server that pages for a host: what cannot be done
/// for a batch (a budget too small for the arena) fails the host's batch
/// with the node's error, and the node serves on.
static NODE: AtomicBool = AtomicBool::new(false);

/// This process is an rpc-server paging for its hosts.
pub fn serve_as_node() {
    NODE.store(true, Ordering::Release);
    allow_batch_abort();
}

/// True where a batch that cannot be computed fails, not the process: a
/// host program (`embed`) or an rpc-server node (`serve_as_node`).
pub fn fails_batches() -> bool {
    EMBEDDED.load(Ordering::Acquire) || NODE.load(Ordering::Acquire)
}

/// This process is a host program that loaded sdq's libllama.
pub fn embed() {
    EMBEDDED.store(true, Ordering::Release);
    allow_batch_abort();
}

/// True where a failed batch fails alone and the process goes on
/// (llama-server, a host program, an rpc-server node).
pub fn batches_fail_alone() -> bool {
    BATCH_ABORT.supported.load(Ordering::Acquire)
}

/// The tool abandons a batch whose expert read failed and goes on (llama-server).
pub fn allow_batch_abort() {
    BATCH_ABORT.supported.store(true, Ordering::Release);
}

/// ggml's abort callback: true once after a batch was abandoned. ggml asks
/// after each node, and stops the graph at the first true; so when it asks
/// again after that, it runs the next graph, and the abandoned batch is over.
pub fn abort_requested() -> bool {
    match BATCH_ABORT.state.load(Ordering::Acquire) {
        REQUESTED => {
            BATCH_ABORT.state.store(STOPPING, Ordering::Release);
            true
        }
        STOPPING => {
            BATCH_ABORT.state.store(IDLE, Ordering::Release);
            false
        }
        _ => false,
    }
}

/// The error that abandoned the last batch, once.
pub fn take_batch_error() -> Option<String> {
    BATCH_ABORT.error.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// What a call from C or C++ was doing, which decides where a panic in it
/// goes (see `guard_or`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum During {
    /// Loading a model or making its context: the load fails.
    Load,
    /// Building or computing a batch's graph: the batch fails.
    Batch,
    /// Answering a question (a report, an error message): the answer is
    /// the fallback, with the error said.
    Query,
}

/// What a call from C or C++ returns when sdq's code in it failed (its
/// error already recorded): nothing, false, 0 or NULL. `guard_or` takes
/// another where those would mean something else.
pub trait Fallback {
    fn fallback() -> Self;
}

impl Fallback for () {
    fn fallback() {}
}

impl Fallback for bool {
    fn fallback() -> bool {
        false
    }
}

macro_rules! zero_fallback {
    ($($t:ty),*) => {$(impl Fallback for $t { fn fallback() -> $t { 0 } })*};
}
zero_fallback!(i32, u32, i64, u64, usize);

impl<T> Fallback for *mut T {
    fn fallback() -> *mut T {
        std::ptr::null_mut()
    }
}

impl<T> Fallback for *const T {
    fn fallback() -> *const T {
        std::ptr::null()
    }
}

/// Runs `f`, a callback from C or C++ computing or building a batch: a
/// panic in it (or `fatal` inside a host program) fails the batch and the
/// callback returns the fallback. See `guard_or`.
pub fn guard<T: Fallback>(what: &str, f: impl FnOnce() -> T) -> T {
    guard_or(what, During::Batch, T::fallback(), f)
}

/// As `guard`, for a callback of a model's load or its context's creation:
/// a panic fails the load.
pub fn guard_load<T: Fallback>(what: &str, f: impl FnOnce() -> T) -> T {
    guard_or(what, During::Load, T::fallback(), f)
}

/// Runs `f` (a callback from C or C++, which nothing may unwind into); a
/// panic in it becomes the error of what the call was doing (`during`),
/// named by `what` and the panic's message, and the call returns
/// `fallback`: a tool ends with the error line (llama-server abandons the
/// batch and serves on); inside a host program the load or the batch fails
/// and the program goes on.
pub fn guard_or<T>(what: &str, during: During, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch(f) {
        Ok(v) => v,
        Err(Failure::Fatal(msg)) => fail(during, &msg, fallback),
        Err(Failure::Panic(text)) => fail(during, &format!("internal error in {what}: {text}"), fallback),
    }
}

fn fail<T>(during: During, msg: &str, fallback: T) -> T {
    match during {
        During::Load => fail_load(msg),
        During::Batch => fail_batch(msg),
        During::Query if embedded() => say_error(&format!("sdq: error: {msg}")),
        During::Query => fatal(msg),
    }
    fallback
}
