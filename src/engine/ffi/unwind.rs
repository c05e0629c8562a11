//! Keeping Rust's panics on sdq's side of the FFI boundary: `catch` runs
//! sdq's code at every edge C or C++ calls (the hooks, ggml's ops) and where
//! a thread of sdq's must live on (the pager's readers), and turns a panic
//! into an error value; the panic hook says a panic caught there once,
//! where it becomes an error, and any other in one line. Inside a host
//! program `fatal` unwinds to the nearest `catch` too (`raise_fatal`).

use std::cell::{Cell, RefCell};

/// Why `catch`'s closure did not return.
#[derive(Debug)]
pub enum Failure {
    /// `fatal` inside a host program, with its message.
    Fatal(String),
    /// A panic: its message and where it happened.
    Panic(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Fatal(msg) => f.write_str(msg),
            Failure::Panic(text) => write!(f, "internal error: {text}"),
        }
    }
}

/// The payload `fatal` unwinds with inside a host program.
struct Fatal(String);

/// Unwinds to the nearest `catch` with `msg` as its error (`Failure::Fatal`).
pub fn raise_fatal(msg: &str) -> ! {
    std::panic::panic_any(Fatal(msg.to_string()))
}

thread_local! {
    /// How many `catch`es this thread is inside.
    static CATCHES: Cell<u32> = const { Cell::new(0) };
    /// The last panic's message and place on this thread (the panic hook's).
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// True inside a `catch` on this thread.
pub fn in_catch() -> bool {
    CATCHES.with(|g| g.get() > 0)
}

/// Runs `f`, returning its panic (or a host program's `fatal`) as an error
/// instead of unwinding further. For the edges of sdq's code: every call
/// from C or C++ (`runtime::failure::guard`), and the pager's reads, whose
/// threads must live on (a read's panic becomes that read's error).
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, Failure> {
    CATCHES.with(|g| g.set(g.get() + 1));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHES.with(|g| g.set(g.get() - 1));
    result.map_err(|payload| match payload.downcast::<Fatal>() {
        Ok(fatal) => Failure::Fatal(fatal.0),
        Err(_) => Failure::Panic(LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| "a panic".into())),
    })
}

/// Replaces the panic message (and its backtrace hint) with sdq's: inside
/// a `catch` the panic is remembered for the error it becomes, and said
/// there; anywhere else it is one line on stderr.
pub fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            if info.payload().is::<Fatal>() {
                return;
            }
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            let text = match info.location() {
                Some(at) => format!("{msg} (at {}:{})", at.file(), at.line()),
                None => msg,
            };
            if in_catch() {
                log::debug!("panic on thread {:?}: {text}", std::thread::current().name());
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
            } else {
                stderr_line!("sdq: internal error: {text}");
            }
        }));
    });
}
