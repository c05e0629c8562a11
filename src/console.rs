//! Lines on stderr, each written whole.
//!
//! llama.cpp's log writes from a thread of its own, and `eprintln!` writes a
//! line in pieces (one `write` per formatted argument), so one of sdq's lines
//! could be cut by one of llama.cpp's: a test or a script that looks for the
//! line would not find it. [`stderr_line!`](crate::stderr_line) formats the
//! line first and writes it with one call.

use std::io::Write;

/// Writes `args` and a newline to stderr in one `write_all` (one `write(2)`
/// for any line shorter than a pipe's buffer, which the kernel does not
/// interleave with another writer's). Errors are dropped, where `eprintln!`
/// would panic on them and a closed stderr must not end a run.
#[doc(hidden)]
pub fn write_line(args: std::fmt::Arguments<'_>) {
    let mut line = std::fmt::format(args);
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `eprintln!`, but the line reaches stderr in one write.
#[macro_export]
macro_rules! stderr_line {
    () => {
        $crate::console::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::console::write_line(format_args!($($arg)*))
    };
}
