//! sdq's own subcommands: each uses the engine's pieces from outside a
//! tool's process (the CLI itself is `src/bin/sdq.rs`).

pub mod demo;
pub mod diskbench;
pub mod eval;
pub mod genmodel;
pub mod inspect;
pub mod limit;
pub mod replay;
