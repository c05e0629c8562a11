//! Integration tests: real binaries, real GGUF files, real processes.

// The test harness captures a test's stderr whole; no llama.cpp thread
// writes into it.
#![allow(clippy::disallowed_macros)]

mod archs;
mod badinput;
mod browser;
mod endpoints;
mod families;
mod far;
mod faults;
mod genmodel;
mod inspect;
mod library;
mod limit;
mod load;
mod pager;
mod pages;
mod replay;
mod rpc;
mod server;
mod split;
mod tools;
mod util;
mod vision;
