//! The engine: sdq inside a llama.cpp process. Its modules are layers, each
//! using only those listed before it:
//!
//! 1. [`ffi`]: the generated bindings and safe access to ggml's types,
//!    kernels and quantizers, and the few llama.cpp calls sdq makes itself.
//! 2. [`model`]: GGUF metadata and the byte accounting of a model's parts.
//! 3. [`memory`]: sizes, the process's memory, the budget rule, cgroup
//!    limits, and the plan for what the tools allocate after load.
//! 4. [`pager`]: the arena of slots, the eviction policies, the reader
//!    threads: experts in and out of RAM, with no knowledge of llama.cpp.
//! 5. [`routing`]: routing kept across runs (traces, hot sets).
//! 6. [`runtime`]: the process's state while a budget is set: options,
//!    the loader's registry, the pager's creation, phases, failures, stats.
//! 7. [`moe`]: the expert op ggml calls for a paged layer.
//! 8. [`rpc`]: across machines: the weights a host's RPC nodes page, and a
//!    node's own copy of the model.
//! 9. [`hooks`]: the hook table llama.cpp calls into, and the paged buffer
//!    type.

pub mod ffi;
pub mod hooks;
pub mod memory;
pub mod model;
pub mod moe;
pub mod pager;
pub mod routing;
pub mod rpc;
pub mod runtime;
