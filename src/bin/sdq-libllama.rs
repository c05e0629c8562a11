//! `libllama.so` with sdq's pager inside: built as a shared object (build/link.rs
//! links this target with `-shared`, upstream's SONAME and llama.cpp's and
//! ggml's archives whole) and installed as target/release/lib/libllama.so.
//! Loading it runs `sdq::host::library::init_from_env`.
#![no_main]

/// Run by the dynamic loader when the library is loaded.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    sdq::host::library::init_from_env();
}
