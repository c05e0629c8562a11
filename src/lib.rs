//! sdq: run mixture-of-experts GGUF models larger than RAM.
//!
//! The crate builds the pinned llama.cpp (see `build.rs`), links its tools
//! into drop-in binaries, and pages the routed experts of a model from its
//! file into a fixed arena while ggml does the routing and the arithmetic.
//! The source is laid out in three parts, each only using the ones before:
//!
//! - [`engine`]: what runs inside a llama.cpp process under a budget, by
//!   concept and in layers (bindings, model metadata, memory, the pager,
//!   routing records, the process state, the expert op, the hooks llama.cpp
//!   calls). Its own doc gives the layers' order.
//! - [`host`]: where the engine starts: the drop-in tools' entry
//!   (`llama-cli`, `llama-server`, …) and `libllama.so`'s load in a program
//!   that links llama.cpp.
//! - [`commands`]: sdq's own subcommands (`sdq demo`, `gen-model`, `inspect`,
//!   `replay`, `limit`, `eval`, `bench-disk`), which use the engine's pieces
//!   but are never part of a tool's process.
//!
//! Beside them, [`error`] (the crate's error type), [`units`] (sizes
//! parsed and shown), [`files`] (files replaced whole) and [`console`]
//! (lines on stderr written whole), which everything may use.
//!
//! `src/bin/` holds one thin `main` per binary. The C++ side talks to the
//! engine through one header, `shim/sdq-hooks.h`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

// First, so that its macro is in scope in every module after it.
#[macro_use]
pub mod console;

pub mod commands;
pub mod engine;
pub mod error;
pub mod files;
pub mod host;
pub mod units;

pub use error::{Error, Result};
