//! Integration tests: real binaries, real GGUF files, real processes.

mod genmodel;
mod pager;
mod tools;
mod util;

