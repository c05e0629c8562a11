//! The tool shims (cc) and the Rust bindings (bindgen, into
//! OUT_DIR/bindings.rs) of the C headers sdq calls and implements.

use std::path::Path;

use crate::fail;

/// The upstream tools the Cargo binaries run (entry shims in shim/tools/).
const TOOLS: &[&str] = &[
    "cli",
    "completion",
    "server",
    "bench",
    "batched-bench",
    "perplexity",
    "quantize",
    "gguf-split",
    "imatrix",
    "tokenize",
    "mtmd-cli",
    "test-llama-archs",
    "rpc-server",
];

/// One object per tool, so each binary links only the tool it runs.
pub fn compile_shims(root: &Path) {
    let mut build = cc::Build::new();
    build.cpp(true).std("c++17");
    for tool in TOOLS {
        build.file(root.join(format!("shim/tools/{tool}.cpp")));
    }
    build.compile("sdq_tool_shims");
}

/// The headers bindgen reads.
const HEADERS: &[&str] = &["ggml.h", "ggml-cpu.h", "ggml-backend.h", "ggml-rpc.h", "gguf.h", "llama.h"];

pub fn generate(root: &Path, src: &Path, out: &Path, clang_includes: Option<&Path>) {
    let mut builder = bindgen::Builder::default();
    if let Some(dir) = clang_includes {
        builder = builder.clang_arg(format!("-isystem{}", dir.display()));
    }
    let mut builder = builder
        .clang_arg(format!("-I{}", src.join("ggml/include").display()))
        .clang_arg(format!("-I{}", src.join("include").display()))
        .allowlist_function("(ggml|gguf|llama|sdq)_.*")
        .allowlist_type("(ggml|gguf|llama|sdq)_.*")
        .allowlist_var("(GGML|GGUF|LLAMA|SDQ)_.*")
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_default(true);
    for header in HEADERS {
        let dir = if header.starts_with("llama") { "include" } else { "ggml/include" };
        builder = builder.header(src.join(dir).join(header).to_string_lossy());
    }
    // The buffer and buffer-type vtables the paged buffer type implements.
    builder = builder.header(src.join("ggml/src/ggml-backend-impl.h").to_string_lossy());
    builder = builder.header(root.join("shim/sdq-hooks.h").to_string_lossy());
    builder
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed (is libclang installed?): {e}")))
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("writing bindings: {e}")));
}
