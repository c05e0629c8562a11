//! The llama.cpp calls sdq makes on its own behalf, outside any tool's
//! request: the log (sdq's error lines reach a host program's own log
//! callback) and sizing a context or a projector from a file's metadata.

use crate::engine::ffi::sys;
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

/// A log callback that shows only errors (sdq's own loads of a model's
/// metadata would otherwise print llama.cpp's whole load log).
///
/// # Safety
/// `text` must be a NUL-terminated string, as ggml passes it.
pub unsafe extern "C" fn quiet_log(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if level >= sys::GGML_LOG_LEVEL_ERROR {
        // SAFETY: ggml passes a NUL-terminated message.
        eprint!("{}", unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy());
    }
}

/// llama.cpp's own log callback, as it was when sdq was installed: a host
/// program that sets another (llama_log_set) collects llama.cpp's lines.
static DEFAULT_LOG: OnceLock<usize> = OnceLock::new();

/// The log callback llama.cpp has now, and its data.
fn current_log() -> (sys::ggml_log_callback, *mut c_void) {
    let mut callback: sys::ggml_log_callback = None;
    let mut data: *mut c_void = std::ptr::null_mut();
    // SAFETY: llama_log_get writes the current callback and its data into
    // the two places given.
    unsafe { sys::llama_log_get(&mut callback, &mut data) };
    (callback, data)
}

/// Notes llama.cpp's callback as it is now (when sdq installs its hooks) as
/// the default, which `log_error` need not write to twice.
pub fn remember_default_log() {
    if let (Some(log), _) = current_log() {
        let _ = DEFAULT_LOG.set(log as usize);
    }
}

/// Writes `line` on stderr and, where the host program set its own log
/// callback, to that callback at error level too: a program that collects
/// llama.cpp's errors in its own log finds sdq's there (llama-cpp-python's
/// callback shows them only when verbose, so stderr stays).
pub fn log_error(line: &str) {
    stderr_line!("{line}");
    let (callback, data) = current_log();
    let Some(log) = callback else { return };
    if DEFAULT_LOG.get().is_some_and(|&d| d == log as usize) {
        return;
    }
    let Ok(text) = std::ffi::CString::new(format!("{line}\n")) else { return };
    // SAFETY: the callback llama.cpp itself would call, with its data and a
    // NUL-terminated line that outlives the call.
    unsafe { log(sys::GGML_LOG_LEVEL_ERROR, text.as_ptr(), data) };
}

/// The compute buffers a context of the model at `path` uses in host memory
/// at these sizes for a full ubatch asking one output (what a generating
/// tool touches of what it reserves), from its metadata (a no_alloc load:
/// no tensor data is read); None if llama.cpp cannot load it.
pub fn context_compute_bytes(path: &std::path::Path, n_ctx: u32, n_batch: u32, n_ubatch: u32) -> Option<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut bytes = 0u64;
    // SAFETY: c is a NUL-terminated path and bytes a valid out-pointer; the
    // wrapper loads the model's metadata, creates and frees a context, and
    // returns. Only warnings and errors are logged meanwhile.
    let r = unsafe {
        sys::llama_log_set(Some(quiet_log), std::ptr::null_mut());
        sys::llama_backend_init();
        sys::sdq_context_compute_bytes(c.as_ptr(), n_ctx, n_batch, n_ubatch, &mut bytes)
    };
    (r == 0).then_some(bytes)
}

/// What the projector at `path` takes once loaded on the CPU (weights and
/// the compute buffers mtmd reserves), from its metadata; None if mtmd
/// cannot read it.
pub fn projector_memory(path: &std::path::Path) -> Option<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut total = 0u64;
    // SAFETY: c is a NUL-terminated path and total a valid out-pointer; the
    // wrapper only reads the file's metadata and returns.
    let r = unsafe { sys::sdq_mtmd_memory(c.as_ptr(), 1, &mut total) };
    (r == 0).then_some(total)
}
