//! Where the engine starts: [`tools`] runs an upstream tool's entry with
//! sdq's options taken out of argv; [`library`] installs the engine when a
//! program loads sdq's `libllama.so` with `SDQ_RAM_BUDGET` set.

pub mod library;
pub mod tools;
