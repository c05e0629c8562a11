//! The FFI floor: bindgen's bindings ([`sys`]), safe access to ggml's types
//! and kernels ([`ggml`]), and the llama.cpp calls sdq makes on its own
//! behalf ([`llama`]: sizing a context or projector, the log).

pub mod ggml;
pub mod llama;
pub mod sys;
