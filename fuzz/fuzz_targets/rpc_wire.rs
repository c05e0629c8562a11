//! rpc-server's wire: an in-process RPC server (ggml's, with patch 0015)
//! on loopback is sent the input as commands after a valid HELLO, and must
//! refuse what is malformed (truncated, oversized, of the wrong size,
//! unknown, naming buffers it never allocated) without crashing. The input
//! is a list of commands: a command byte, a declared size (u24) and up to
//! that many payload bytes; a graph to compute is only ever sent truncated
//! (its tensors are the host's to get right, as upstream trusts them), and
//! allocations are capped at 16 MiB.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::Duration;

use sdq::engine::ffi::sys;

const HELLO: u8 = 14;
const ALLOC_BUFFER: u8 = 0;
const GRAPH_COMPUTE: u8 = 10;

/// The server's port: started once, in a thread of this process.
fn server() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::thread::spawn(move || {
            let endpoint = std::ffi::CString::new(format!("127.0.0.1:{port}")).unwrap();
            // SAFETY: ggml's CPU device is static; the endpoint outlives the
            // call, which serves clients until the process ends.
            unsafe {
                let mut dev = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU);
                sys::ggml_backend_rpc_start_server(endpoint.as_ptr(), std::ptr::null(), 1, 1, &mut dev);
            }
        });
        for _ in 0..200 {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        port
    })
}

/// The input as commands for the server (see the file's comment).
fn commands(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = data;
    while rest.len() >= 4 {
        let cmd = rest[0];
        let declared = u64::from(rest[1]) | u64::from(rest[2]) << 8 | u64::from(rest[3]) << 16;
        rest = &rest[4..];
        let n = (declared as usize).min(rest.len());
        let mut payload = rest[..n].to_vec();
        rest = &rest[n..];
        if cmd == ALLOC_BUFFER && payload.len() >= 12 {
            // device (u32) then size (u64): at most 16 MiB.
            let size = u64::from_le_bytes(payload[4..12].try_into().unwrap()) % (16 << 20);
            payload[4..12].copy_from_slice(&size.to_le_bytes());
        }
        out.push(cmd);
        if cmd == GRAPH_COMPUTE {
            // Declared longer than sent: the server waits for the rest and
            // finds the connection closed.
            out.extend_from_slice(&(payload.len() as u64 + 1).to_le_bytes());
            out.extend_from_slice(&payload);
            break;
        }
        out.extend_from_slice(&declared.to_le_bytes());
        out.extend_from_slice(&payload);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let port = server();
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut hello = vec![HELLO];
    hello.extend_from_slice(&24u64.to_le_bytes());
    hello.extend_from_slice(&[0u8; 24]);
    if s.write_all(&hello).is_err() {
        return;
    }
    let _ = s.write_all(&commands(data));
    let _ = s.shutdown(std::net::Shutdown::Write);
    // The server closes the connection once it has refused or served it all;
    // until then the next input would wait behind this one.
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
});
