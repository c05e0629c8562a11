//! The server endpoints people use besides `/completion`, each once under
//! a budget against stock llama-server with the same flags: streamed chat
//! completions, tokenizing, a slot saved and restored, a LoRA adapter
//! (`--lora`, one `sdq gen-model --lora` writes, adapting paged experts
//! too), and embeddings.

use crate::server::stop;
use crate::util::*;
use serde_json::{json, Value};

/// The body of a chunked response, joined.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { return body.to_string() };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].strip_prefix("\r\n").unwrap_or(&tail[n..]);
    }
    out
}

/// The events of a streamed `/v1/chat/completions` with `body` (answered
/// 200, none an error), and whether the stream ended with `[DONE]`.
pub(crate) fn chat_events(port: u16, body: &Value) -> (Vec<Value>, bool) {
    let (status, text) = http(port, "POST", "/v1/chat/completions", Some(&body.to_string())).expect("an answer within its timeout");
    assert_eq!(status, 200, "{text}");
    let mut done = false;
    let mut events = Vec::new();
    for line in dechunk(&text).lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line.trim() == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v.get("error").is_none(), "{v}");
        events.push(v);
    }
    (events, done)
}

/// The text of streamed events: their content deltas, joined.
pub(crate) fn streamed_content(events: &[Value]) -> String {
    events.iter().filter_map(|v| v["choices"][0]["delta"]["content"].as_str()).collect()
}

/// A streamed chat completion's text: its SSE events' content deltas.
fn streamed_chat(port: u16, message: &str) -> String {
    let body = json!({ "messages": [{ "role": "user", "content": message }], "stream": true, "max_tokens": 24, "top_k": 1 });
    let (events, done) = chat_events(port, &body);
    let content = streamed_content(&events);
    assert!(done && !content.is_empty(), "no streamed answer: {events:?}");
    content
}

fn post(port: u16, path: &str, body: Value) -> Value {
    let (status, text) = http(port, "POST", path, Some(&body.to_string())).unwrap();
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

fn complete(port: u16, prompt: &str) -> String {
    post(port, "/completion", json!({ "prompt": prompt, "n_predict": 16, "top_k": 1, "id_slot": 0 }))["content"].as_str().unwrap().to_string()
}

/// Everything a session asks of one server, in order: what must match stock.
fn session(port: u16, tag: &str) -> Vec<Value> {
    let mut out = vec![json!(streamed_chat(port, "Tell me about the rivers of the north"))];
    out.push(post(port, "/tokenize", json!({ "content": "The rivers and the mountains", "with_pieces": true })));
    out.push(post(port, "/detokenize", json!({ "tokens": [785, 35517, 323, 279, 23501] })));
    // A slot saved after one prompt, another prompt in between, the slot
    // restored, and the first prompt continued from the restored cache.
    let first = "The history of the city began with a small harbour";
    out.push(json!(complete(port, first)));
    let saved = post(port, "/slots/0?action=save", json!({ "filename": format!("{tag}.bin") }));
    assert!(saved["n_saved"].as_u64().unwrap() > 0, "{saved}");
    out.push(json!(complete(port, "Count: one two three four")));
    let restored = post(port, "/slots/0?action=restore", json!({ "filename": format!("{tag}.bin") }));
    assert_eq!(restored["n_restored"], saved["n_saved"], "{restored}");
    out.push(json!(complete(port, first)));
    out
}

#[test]
fn chat_streaming_tokenize_slots_lora_and_embeddings_answer_as_stock() {
    let model = scratch().join("endpoints.gguf");
    let lora = scratch().join("endpoints-lora.gguf");
    let o = run(std::process::Command::new(bin("sdq")).args(["gen-model", "--preset", "tiny", "--seed", "1", "-o"]).arg(&model).arg("--lora").arg(&lora), 120);
    assert!(o.status.success(), "{}", stderr(&o));
    let (model, lora) = (TempModel::adopt(model), TempModel::adopt(lora));
    let slots = scratch().join("endpoints-slots");
    std::fs::create_dir_all(&slots).unwrap();
    let m = model.to_str().unwrap();
    let args = ["-m", m, "--no-warmup", "-np", "1", "--lora", lora.to_str().unwrap(), "--slot-save-path", slots.to_str().unwrap()];

    let (server, port) = start_server(&args);
    let stock = session(port, "stock");
    drop(server);
    // Without the adapter the answers differ: it is applied.
    let (server, port) = start_server(&["-m", m, "--no-warmup", "-np", "1"]);
    assert_ne!(complete(port, "The history of the city began with a small harbour"), stock[3], "the LoRA adapter changed nothing");
    drop(server);

    let stats = scratch().join("endpoints-stats.json");
    let budgeted = [&args[..], &["--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()]].concat();
    let (server, port) = start_server_env(&budgeted, &[("SDQ_PRELOAD", "0")]);
    let paged = session(port, "paged");
    assert!(stop(server).success());
    for (i, what) in ["streamed chat", "/tokenize", "/detokenize", "completion", "completion between", "completion after restore"].iter().enumerate() {
        assert_eq!(paged[i], stock[i], "{what}: unlike stock");
    }
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0, "{s}");

    // Embeddings: the pooled vectors are stock's, bit for bit.
    let embed = |port: u16| -> Value { post(port, "/v1/embeddings", json!({ "input": ["The rivers and the mountains", "A small harbour"] })) };
    let args = ["-m", m, "--no-warmup", "--embeddings", "--pooling", "mean"];
    let (server, port) = start_server(&args);
    let stock = embed(port);
    drop(server);
    let (server, port) = start_server_env(&[&args[..], &["--ram-budget", "1G"]].concat(), &[("SDQ_PRELOAD", "0")]);
    let paged = embed(port);
    assert!(stop(server).success());
    let vectors = |v: &Value| -> Vec<Vec<f64>> {
        v["data"].as_array().unwrap().iter().map(|d| d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
    };
    let (s, p) = (vectors(&stock), vectors(&paged));
    assert!(s.len() == 2 && s[0].len() > 100, "{stock}");
    assert_eq!(p, s, "embeddings unlike stock");
}
