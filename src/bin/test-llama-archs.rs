//! `test-llama-archs`: upstream's architecture test, linked with sdq. Its
//! `-o DIR` writes a small model of every architecture the pinned tree
//! knows, which the tests run under budgets (tests/it/archs.rs).
fn main() {
    sdq::host::tools::run(sdq::host::tools::entry::sdq_tool_test_llama_archs)
}
