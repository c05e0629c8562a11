//! sdq: run mixture-of-experts GGUF models larger than RAM.
//!
//! The crate builds the pinned llama.cpp (see `build.rs`), links its tools into
//! drop-in binaries (`src/bin/`), and generates MoE models to run them on
//! ([`genmodel`]). The routed-expert pager plugs into llama.cpp through the hook
//! table declared in `shim/sdq-hooks.h`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod budget;
pub mod demo;
pub mod diskbench;
pub mod error;
pub mod eval;
pub mod genmodel;
pub mod ggml;
pub mod gguf;
pub mod growth;
pub mod hotset;
pub mod hooks;
pub mod inspect;
pub mod library;
pub mod limit;
pub mod metrics;
pub mod moe;
pub mod options;
pub mod pager;
pub mod phases;
pub mod preflight;
pub mod pressure;
pub mod replay;
pub mod runtime;
pub mod sys;
pub mod tools;
pub mod trace;

pub use error::{Error, Result};
