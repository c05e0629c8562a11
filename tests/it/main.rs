//! Integration tests: real binaries, real GGUF files, real processes.

mod genmodel;
mod tools;
mod util;
