//! `llama-tokenize`: upstream's tool, linked with sdq (same flags, output and exit codes).
fn main() {
    sdq::tools::run(sdq::tools::entry::sdq_tool_tokenize)
}
