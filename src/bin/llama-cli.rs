//! `llama-cli`: upstream's tool, linked with sdq (same flags, output and exit codes).
fn main() {
    sdq::host::tools::run(sdq::host::tools::entry::sdq_tool_cli)
}
