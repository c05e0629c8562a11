//! Across machines: llama.cpp's RPC backend with sdq's rpc-server on each
//! node. Two nodes on loopback, each its own process (inside its own
//! `sdq limit` where the machine allows one), a host tool with `--rpc`.

use crate::util::*;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// One `rpc-server` on a free loopback port, in `sdq limit --memory LIMIT`,
/// paging from `model` under `budget` when both are given. Dropped: killed.
struct Node {
    runner: Child,
    pid: u32,
    port: u16,
    stats: PathBuf,
    log: PathBuf,
}

impl Node {
    fn start(name: &str, paged: Option<(&Path, &str)>, env: &[(&str, &str)]) -> Node {
        let port = free_port();
        let stats = scratch().join(format!("rpc-{name}-{port}.json"));
        let log = scratch().join(format!("rpc-{name}-{port}.log"));
        let report = scratch().join(format!("rpc-{name}-{port}-limit.json"));
        let _ = std::fs::remove_file(&stats);
        let mut cmd = Command::new(bin("sdq"));
        cmd.args(["limit", "--memory", "2G", "--report", report.to_str().unwrap(), "--"]).arg(bin("rpc-server")).args([
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            "1",
        ]);
        if let Some((model, budget)) = paged {
            cmd.args(["-m", model.to_str().unwrap(), "--ram-budget", budget, "--sdq-reserve", "16M", "--sdq-stats", stats.to_str().unwrap()]);
        }
        // Its stdout (upstream's lines: devices, connections) and stderr (sdq's) in one log.
        let file = std::fs::File::create(&log).unwrap();
        let runner =
            cmd.envs(env.iter().copied()).stdin(Stdio::null()).stdout(Stdio::from(file.try_clone().unwrap())).stderr(Stdio::from(file)).spawn().unwrap();
        let pid = child_of(runner.id());
        let mut node = Node { runner, pid, port, stats, log };
        poll_until(60, || {
            if let Ok(Some(status)) = node.runner.try_wait() {
                panic!("rpc-server exited early: {status}\n{}", node.log());
            }
            TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        })
        .unwrap_or_else(|| panic!("rpc-server not listening within 60 s\n{}", node.log()));
        node
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops it as a user would (Ctrl-C) and returns its stderr.
    fn stop(mut self) -> String {
        interrupt_until_exit(self.pid, || self.runner.try_wait().unwrap()).expect("rpc-server stops on SIGINT");
        self.log()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.runner.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling the rpc-server this test started.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
            let _ = self.runner.wait();
        }
    }
}

fn rpc_arg(nodes: &[&Node]) -> String {
    nodes.iter().map(|n| n.endpoint()).collect::<Vec<_>>().join(",")
}

/// llama-completion over `nodes` (every layer on them, `-ngl` as given),
/// greedy; extra arguments after.
fn complete(model: &Path, nodes: &[&Node], ngl: &str, extra: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut args = completion_args(model, "The capital of France is", 24);
    args.extend(["--rpc".to_string(), rpc_arg(nodes), "-ngl".to_string(), ngl.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    run(Command::new(bin("llama-completion")).args(&args).envs(env.iter().copied()), 300)
}

#[test]
fn rpc_server_is_the_drop_in_and_paged_nodes_answer_as_the_same_split() {
    let model = tiny();
    // Upstream's RPC: two stock nodes, every layer on them.
    let (a, b) = (Node::start("stock-a", None, &[]), Node::start("stock-b", None, &[]));
    let stock = complete(model, &[&a, &b], "99", &[], &[]);
    assert!(stock.status.success(), "{:?}\n{}\n{}\n{}", stock.status, stderr(&stock), a.log(), b.log());
    let text = stdout(&stock);
    assert!(text.len() > "The capital of France is".len(), "{text}");
    let (la, lb) = (a.stop(), b.stop());
    assert!(la.contains("Accepted client connection") && lb.contains("Accepted client connection"), "{la}\n{lb}");

    // The same split, each node paging its layers' experts from its own
    // copy, the host under a budget too: first with room for every expert,
    // then each node with an arena of one layer's top-k and a little more,
    // below its layers' experts (from what the first run held).
    let host_stats = scratch().join("rpc-host.json");
    let host_budget = ["--ram-budget", "1G", "--sdq-stats", host_stats.to_str().unwrap()];
    let mut budgets = ["1G".to_string(), "1G".to_string()];
    for round in 0..2 {
        let a = Node::start(&format!("paged-a{round}"), Some((model, &budgets[0])), &[]);
        let b = Node::start(&format!("paged-b{round}"), Some((model, &budgets[1])), &[]);
        let paged = complete(model, &[&a, &b], "99", &host_budget, &[]);
        assert!(paged.status.success(), "{}\nnode a:\n{}\nnode b:\n{}", stderr(&paged), a.log(), b.log());
        assert_eq!(stdout(&paged), text, "round {round}: paged nodes changed the text");
        let e = stderr(&paged);
        let summary = e.lines().find(|l| l.contains("experts paged on rpc nodes: layers")).unwrap_or_else(|| panic!("no summary naming the nodes:\n{e}"));
        assert!(summary.contains(&format!(" on {}", a.endpoint())) && summary.contains(&format!(" on {}", b.endpoint())), "{summary}");
        for (i, node) in [a, b].into_iter().enumerate() {
            let stats = node.stats.clone();
            let log = node.stop();
            let s: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&stats).unwrap_or_else(|e| panic!("{}: {e}\n{log}", stats.display()))).unwrap();
            assert!(u(&s, "bytes_read") > 0 && log.contains("sdq: hit"), "round {round}: a node read no expert: {s}\n{log}");
            if round == 0 {
                budgets[i] = (held_after_load(&s) + (16 << 20) + min_arena(&s) + (2 << 20)).to_string();
            } else {
                assert!(u(&s, "arena_bytes") < all_arena(&s, 16), "the arena holds every expert of the node's layers: {s}");
                assert!(u(&s["decode"], "misses") > 0, "decode read no expert: {s}");
            }
        }
    }
}

/// The host keeps its first layers (`-ngl 4` of 8: layers 0-4 on its CPU)
/// and pages them as on one machine, the nodes take the rest in an uneven
/// split (`-ts 3,1`), and a node pages from a model split into parts: the
/// same text as that split with no budgets.
#[test]
fn the_host_pages_its_own_layers_beside_nodes_with_split_files() {
    let dir = scratch().join("rpc-split");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let o = run(
        Command::new(bin("sdq"))
            .arg("gen-model")
            .args(small_vocab(&["--preset", "tiny", "--seed", "1", "--split-max-size", "12M"]))
            .arg("-o")
            .arg(dir.join("tiny.gguf")),
        300,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let parts: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    let first = parts.iter().find(|p| p.to_string_lossy().contains("-00001-of-")).unwrap_or_else(|| panic!("no split written: {parts:?}")).clone();
    assert!(parts.len() >= 2, "one part only: {parts:?}");
    let split = ["-ts", "3,1"];
    let stock = {
        let (a, b) = (Node::start("split-stock-a", None, &[]), Node::start("split-stock-b", None, &[]));
        let o = complete(&first, &[&a, &b], "4", &split, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let (a, b) = (Node::start("split-a", Some((&first, "1G")), &[]), Node::start("split-b", Some((&first, "1G")), &[]));
    let host_stats = scratch().join("rpc-split-host.json");
    let mut extra = split.to_vec();
    extra.extend(["--ram-budget", "1G", "--sdq-stats", host_stats.to_str().unwrap()]);
    let o = complete(&first, &[&a, &b], "4", &extra, &[]);
    assert!(o.status.success(), "{}\n{}\n{}", stderr(&o), a.log(), b.log());
    assert_eq!(stdout(&o), stock, "the paged split changed the text");
    let s: serde_json::Value = read_json(&host_stats);
    let host_layers: Vec<u64> = s["layers"].as_array().unwrap().iter().map(|l| u(l, "layer")).collect();
    // llama.cpp counts the output as a layer: -ngl 4 offloads layers 5-7 and the output.
    assert_eq!(host_layers, vec![0, 1, 2, 3, 4], "the host pages its own layers: {s}");
    assert!(u(&s, "bytes_read") > 0, "{s}");
    let mut node_layers = Vec::new();
    for node in [a, b] {
        let stats = node.stats.clone();
        let log = node.stop();
        let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap_or_else(|e| panic!("{e}\n{log}"))).unwrap();
        // With -ts 3,1 one node may hold only the output: it pages nothing.
        node_layers.extend(s["layers"].as_array().into_iter().flatten().map(|l| u(l, "layer")));
    }
    node_layers.sort();
    assert_eq!(node_layers, vec![5, 6, 7], "the nodes page the offloaded layers");
}

#[test]
fn a_node_that_does_not_page_is_a_clear_error_at_load() {
    let model = tiny();
    // A stock node: the host would have to send it every expert.
    let a = Node::start("refuse-stock", None, &[]);
    let o = complete(model, &[&a], "99", &["--ram-budget", "1G"], &[]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(&format!("rpc node {} does not page blk.", a.endpoint())) && e.contains("rpc-server -m MODEL --ram-budget"), "{e}");
    drop(a);

    // A node with another model (another seed: same shapes, other bytes).
    let other = gen_model("rpc-other.gguf", &small_vocab(&["--preset", "tiny", "--seed", "2"]));
    let b = Node::start("refuse-other", Some((&other, "1G")), &[]);
    let o = complete(model, &[&b], "99", &["--ram-budget", "1G"], &[]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(&format!("rpc node {} refuses to page blk.", b.endpoint())) && e.contains("another GGUF header"), "{e}");
    assert!(b.log().contains(other.to_str().unwrap()), "the node names its own file:\n{}", b.log());
}

/// A node whose budget cannot hold one layer's experts beside what the host
/// placed on it fails the host's batch with its own line (the minimum
/// budget), and serves the next host.
#[test]
fn a_node_budget_too_small_fails_the_batch_with_the_nodes_minimum() {
    let model = tiny();
    let a = Node::start("small", Some((model, "20M")), &[]);
    let o = complete(model, &[&a], "99", &["--ram-budget", "1G"], &[]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(&format!("rpc node {}: RAM budget 20.0 MiB is too small", a.endpoint())) && e.contains("the minimum budget is"), "{e}\n{}", a.log());
    assert!(!a.log().contains("panicked"), "{}", a.log());
    let o = complete(model, &[&a], "99", &[], &[]);
    assert!(o.status.success(), "the node serves the next host (upstream's RPC):\n{}\n{}", stderr(&o), a.log());
}

/// A node's failed read fails that batch on the host with the node's error
/// (the node, its file, layer and expert), and llama-server goes on: the
/// next request, read again once the disk is back, answers as the same
/// split with no budgets.
#[test]
fn a_failed_read_on_a_node_fails_that_request_and_the_server_goes_on() {
    let model = tiny();
    let args = |nodes: &[&Node]| -> Vec<String> {
        ["-m", model.to_str().unwrap(), "--no-warmup", "-t", "1", "-c", "512", "--rpc", &rpc_arg(nodes), "-ngl", "99"].iter().map(|s| s.to_string()).collect()
    };
    let request = r#"{"prompt":"Rivers and mountains of the north","n_predict":12,"top_k":1,"cache_prompt":false}"#;
    let content = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap()["content"].as_str().unwrap_or_default().to_string();
    let stock = {
        let (a, b) = (Node::start("fault-stock-a", None, &[]), Node::start("fault-stock-b", None, &[]));
        let args = args(&[&a, &b]);
        let (_server, port) = start_server(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let (code, body) = http(port, "POST", "/completion", Some(request)).unwrap();
        assert_eq!(code, 200, "{body}");
        content(&body)
    };
    let bad_disk = scratch().join("rpc-bad-disk");
    std::fs::write(&bad_disk, b"").unwrap();
    let fault = format!("eio-while={}", bad_disk.display());
    let env = [("SDQ_FAULT_READ", fault.as_str()), ("SDQ_READ_BACKOFF_MS", "1")];
    let (a, b) = (Node::start("fault-a", Some((model, "1G")), &[]), Node::start("fault-b", Some((model, "1G")), &env));
    let mut args = args(&[&a, &b]);
    args.extend(["--ram-budget".to_string(), "1G".to_string()]);
    let log = scratch().join("rpc-fault-server.log");
    let (mut server, port) = start_server_logged(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[], Some(&log));
    let (code, body) = http(port, "POST", "/completion", Some(request)).unwrap();
    assert_eq!(code, 500, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("rpc node {}", b.endpoint()))
            && msg.contains("injected read fault: EIO")
            && msg.contains("of expert")
            && msg.contains("of layer")
            && msg.contains(model.to_str().unwrap()),
        "{body}"
    );
    std::fs::remove_file(&bad_disk).unwrap();
    let (code, body) = http(port, "POST", "/completion", Some(request)).unwrap();
    assert_eq!((code, content(&body)), (200, stock), "{body}");
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    let _ = crate::server::stop(server);
    assert!(b.log().contains("the batch is abandoned") && !b.log().contains("panicked"), "{}", b.log());
}

/// A node that goes away in the middle of a tool's request: the tool
/// names it and ends within seconds; it does not hang.
#[test]
fn a_node_that_goes_away_mid_request_is_named_within_seconds() {
    let model = tiny();
    let slow = [("SDQ_FAULT_READ", "delay=200")];
    let a = Node::start("gone-a", Some((model, "1G")), &slow);
    let mut args = completion_args(model, "The capital of France is", 200);
    args.extend(["--rpc".to_string(), a.endpoint(), "-ngl".to_string(), "99".to_string(), "--ram-budget".to_string(), "1G".to_string()]);
    let host = Command::new(bin("llama-completion")).args(&args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Once the node is reading experts for the host, it goes away.
    stats_when(&a.stats, 60, "the node reads experts", |s| s["bytes_read"].as_u64().unwrap_or(0) > 0);
    let gone = std::time::Instant::now();
    // SAFETY: killing the rpc-server this test started.
    unsafe { libc::kill(a.pid as i32, libc::SIGKILL) };
    let o = wait_with_timeout(host, 60);
    assert!(gone.elapsed().as_secs() < 30, "the host took {:?} to give up", gone.elapsed());
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(&format!("rpc node {} is gone", a.endpoint())) && !e.contains("panicked"), "{e}");
}

/// A node that goes away in the middle of a llama-server request: that
/// request fails within seconds naming the node, and so does the next one
/// (its layers cannot be computed), at once; the server goes on running.
#[test]
fn a_node_that_goes_away_fails_the_servers_requests_and_the_server_goes_on() {
    let model = tiny();
    let a = Node::start("gone-server", Some((model, "1G")), &[("SDQ_FAULT_READ", "delay=200")]);
    let ep = a.endpoint();
    let args = ["-m", model.to_str().unwrap(), "--no-warmup", "-t", "1", "-c", "512", "--rpc", &ep, "-ngl", "99", "--ram-budget", "1G"];
    let log = scratch().join("rpc-gone-server.log");
    let (mut server, port) = start_server_logged(&args, &[], Some(&log));
    let request = r#"{"prompt":"Rivers and mountains of the north","n_predict":200,"top_k":1,"cache_prompt":false}"#;
    let first = std::thread::spawn(move || http(port, "POST", "/completion", Some(request)).unwrap());
    // Once the node is reading experts for the server, it goes away.
    stats_when(&a.stats, 60, "the node reads experts", |s| s["bytes_read"].as_u64().unwrap_or(0) > 0);
    let gone = std::time::Instant::now();
    // SAFETY: killing the rpc-server this test started.
    unsafe { libc::kill(a.pid as i32, libc::SIGKILL) };
    let named = |body: &str| {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        v["error"]["message"].as_str().unwrap_or_default().contains(&format!("rpc node {ep} is gone"))
    };
    let (code, body) = first.join().unwrap();
    assert!(gone.elapsed().as_secs() < 30, "the request took {:?} to fail", gone.elapsed());
    assert!(code == 500 && named(&body), "{code} {body}");
    let again = std::time::Instant::now();
    let (code, body) = http(port, "POST", "/completion", Some(request)).unwrap();
    assert!(code == 500 && named(&body) && again.elapsed().as_secs() < 10, "{code} {body} after {:?}", again.elapsed());
    assert_eq!(http(port, "GET", "/health", None).unwrap().0, 200);
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    let _ = crate::server::stop(server);
    let e = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!e.contains("panicked") && !e.contains("GGML_ASSERT") && !e.contains("Remote RPC server crashed"), "{e}");
}

/// The same inside a host program (tests/c/greedy.c, linked with sdq's
/// libllama, its layers on the node): the batch the loss cut off fails at
/// `llama_decode`'s return, and the program ends as it chooses, with sdq's
/// line in its own log; nothing aborts it. (llama-cpp-python's
/// `rpc_servers` predates this llama.cpp's RPC devices: it loads on the CPU.)
#[test]
fn a_node_that_goes_away_fails_llama_decode_in_a_host_program() {
    let model = tiny();
    let a = Node::start("gone-c", Some((model, "1G")), &[("SDQ_FAULT_READ", "delay=200")]);
    let program = Command::new(crate::library::c_program())
        .args([model.to_str().unwrap(), "200", "Rivers and mountains of the north"])
        .envs([("GREEDY_RPC", a.endpoint().as_str()), ("SDQ_RAM_BUDGET", "1G")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    stats_when(&a.stats, 60, "the node reads experts", |s| s["bytes_read"].as_u64().unwrap_or(0) > 0);
    // SAFETY: killing the rpc-server this test started.
    unsafe { libc::kill(a.pid as i32, libc::SIGKILL) };
    let o = wait_with_timeout(program, 60);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("error: llama_decode returned 2"), "{err}");
    assert!(err.contains(&format!("): sdq: error: rpc node {} is gone", a.endpoint())), "not in the program's log: {err}");
    assert!(!err.contains("panicked") && !err.contains("GGML_ASSERT") && !err.contains("Remote RPC server crashed"), "{err}");
}

/// Bad input on the wire (a truncated command, an oversized one, a graph
/// naming buffers it never allocated, an op of sdq's for a weight it never
/// claimed) is refused, and the node serves the next host as before.
#[test]
fn bad_input_on_the_wire_is_refused_and_the_node_serves_on() {
    use std::io::Write;
    let model = tiny();
    let a = Node::start("wire", Some((model, "1G")), &[]);
    let hello = |s: &mut TcpStream| {
        // RPC_CMD_HELLO (14) with its 24-byte request.
        s.write_all(&[14]).unwrap();
        s.write_all(&24u64.to_le_bytes()).unwrap();
        s.write_all(&[0u8; 24]).unwrap();
    };
    let cases: Vec<Vec<u8>> = vec![
        vec![14, 3, 0],                                                                                                  // truncated HELLO
        [vec![10], (1u64 << 40).to_le_bytes().to_vec()].concat(),                                                        // GRAPH_COMPUTE of 1 TiB
        [vec![10], 16u64.to_le_bytes().to_vec(), vec![0, 0, 0, 0, 255, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0]].concat(), // 2^32-1 nodes in 16 bytes
        [vec![13], 8u64.to_le_bytes().to_vec(), vec![1; 8]].concat(),                                                    // GET_ALLOC_SIZE of the wrong size
        vec![200],                                                                                                       // no such command
    ];
    for (i, bytes) in cases.iter().enumerate() {
        let mut s = TcpStream::connect(("127.0.0.1", a.port)).unwrap();
        if i > 0 {
            hello(&mut s);
        }
        let _ = s.write_all(bytes);
        drop(s);
    }
    let o = complete(model, &[&a], "99", &["--ram-budget", "1G"], &[]);
    assert!(o.status.success(), "{}\n{}", stderr(&o), a.log());
    assert!(!a.log().contains("panicked") && !a.log().contains("GGML_ASSERT"), "{}", a.log());
}
