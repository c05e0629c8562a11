//! What a model file holds: GGUF metadata ([`gguf`]) and the bytes its
//! parts take once loaded ([`accounting`]), for the runtime's plan and
//! `sdq inspect` alike.

pub mod accounting;
pub mod gguf;
