//! The FFI floor: bindgen's bindings ([`sys`]), safe access to ggml's types
//! and kernels ([`ggml`]), and the llama.cpp calls sdq makes on its own
//! behalf ([`llama`]: sizing a context or projector, the log); and
//! [`unwind`], which keeps Rust's panics from crossing into C or C++.

pub mod ggml;
pub mod llama;
pub mod sys;
pub mod unwind;
