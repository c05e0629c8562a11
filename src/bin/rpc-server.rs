//! `rpc-server`: upstream's ggml RPC server, linked with sdq (same flags, output and exit codes).
fn main() {
    sdq::host::tools::run(sdq::host::tools::entry::sdq_tool_rpc_server)
}
