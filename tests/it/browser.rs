//! llama-server's chat page in a real browser: Debian's Chromium, driven by
//! Playwright (the playwright-core of the page's own lockfile, which the
//! build installed to build the page), opens the page of a budgeted server
//! on a generated model, types messages and reads the streamed answers.
//! Needs the page (built where the build found or fetched Node.js) and
//! `/usr/bin/chromium` (`scripts/test` installs Debian's where it can).

use crate::pager::{budget_for, MIB};
use crate::server::stop;
use crate::util::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

const CHROMIUM: &str = "/usr/bin/chromium";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The answer of a non-streamed `/v1/chat/completions` with `request`'s
/// body, from a stock server started for it alone (no prompt cache from
/// another request, as the paged server had none after its failed batch).
fn stock_answer(flags: &[&str], request: &Value) -> String {
    let mut body = request.clone();
    body["stream"] = json!(false);
    let (server, port) = start_server(flags);
    let (status, text) = http(port, "POST", "/v1/chat/completions", Some(&body.to_string())).expect("stock answers");
    drop(server);
    assert_eq!(status, 200, "stock: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
}

fn normalize(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A message answered as stock answers the same request, the page's
/// progress line showing the experts read for its prompt; a message sent
/// while reads fail shows the server's error in the page; the next message
/// is answered as stock answers it. Screenshots of each turn are kept in
/// target/tmp/sdq-it/browser/.
#[test]
fn the_chat_page_answers_as_stock_and_shows_a_failed_read() {
    let page = root().join("target/ui/dist/index.html");
    assert!(page.is_file(), "the chat page was not built ({} is missing): the build's warning says why", page.display());
    let playwright = root().join("target/ui/build/node_modules/playwright-core");
    assert!(playwright.join("package.json").is_file(), "no playwright-core in {} (the page's lockfile installs it)", playwright.display());
    assert!(Path::new(CHROMIUM).is_file(), "no {CHROMIUM}: install Debian's chromium (apt-get install chromium), as scripts/test does where it can");
    let node = option_env!("SDQ_NODE").unwrap_or("node");

    let model = tiny().to_str().unwrap();
    let flags = ["-m", model, "--no-warmup", "--top-k", "1", "-n", "24"];
    // An arena of about one and a half token cycles (the tiny model's
    // experts are 14.5 MiB; one token's 3.6 MiB), so that every message reads.
    let probe_stats = scratch().join("browser-probe-stats.json");
    let (server, _) = start_server(&[&flags[..], &["--ram-budget", "20G", "--sdq-reserve", "64M", "--sdq-stats", probe_stats.to_str().unwrap()]].concat());
    assert!(stop(server).success());
    let probe: Value = read_json(&probe_stats);
    let budget = budget_for(&probe, 64 * MIB, 6 * MIB);

    let shots = scratch().join("browser");
    let _ = std::fs::remove_dir_all(&shots);
    std::fs::create_dir_all(&shots).unwrap();
    let fault = shots.join("reads-fail");
    let stats = shots.join("stats.json");
    let (mut server, port) = start_server_env(
        &[&flags[..], &["--ram-budget", &budget, "--sdq-reserve", "64M", "--sdq-stats", stats.to_str().unwrap()]].concat(),
        // Every read a little slow, so that the page's progress line, which
        // lasts until the first token, is there long enough to be seen.
        &[("SDQ_FAULT_READ", &format!("eio-while={},delay=20", fault.display())), ("SDQ_PRELOAD", "0"), ("SDQ_READ_BACKOFF_MS", "1")],
    );
    let turn = |message: &str, faulty: bool| json!({ "message": message, "fault_file": fault, "fault": faulty });
    let config = json!({
        "url": format!("http://127.0.0.1:{port}/"),
        "chromium": CHROMIUM,
        "playwright": playwright,
        "shots": shots,
        "turns": [
            turn("Tell me about the rivers of the north", false),
            turn("And the mountains beside them?", true),
            turn("Which of them is the oldest?", false),
        ],
    });
    let config_file = shots.join("config.json");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let o = run(Command::new(node).arg(root().join("tests/browser/chat.mjs")).arg(&config_file), 300);
    assert!(o.status.success(), "the browser run failed: {}\n{}", stderr(&o), stdout(&o));
    let turns: Value = serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    let turns = turns["turns"].as_array().unwrap();
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    assert!(stop(server).success());
    std::fs::write(shots.join("turns.json"), serde_json::to_string_pretty(turns).unwrap()).unwrap();

    for i in [0, 2] {
        let t = &turns[i];
        let what = format!("turn {}", i + 1);
        assert_eq!(t["status"], 200, "{what}: {t}");
        assert!(t["stream_error"].is_null(), "{what}: {t}");
        let streamed = t["streamed"].as_str().unwrap();
        assert!(!streamed.trim().is_empty(), "{what}: an empty answer: {t}");
        assert_eq!(t["shown"].as_str().unwrap(), normalize(streamed), "{what}: the page shows other text than it was sent");
        assert_eq!(streamed, stock_answer(&flags, &t["request"]), "{what}: answered unlike stock to the same request");
        // The progress line with the experts read for the prompt (patch 0014).
        let progress: Vec<&str> = t["progress_shown"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        let shown_reads = |p: &&str| p.starts_with("Processing") && p.contains(" · experts read ") && p.ends_with(" MiB");
        assert!(progress.iter().any(shown_reads), "{what}: the page showed no progress line with the experts read: {progress:?}");
    }
    let failed = &turns[1];
    let error = failed["stream_error"].as_str().unwrap_or_else(|| panic!("turn 2 did not fail: {failed}"));
    assert!(error.contains("injected read fault: EIO") && error.contains("of expert") && error.contains(model), "{error}");
    let shown = failed["error_shown"].as_str().unwrap();
    assert!(shown.contains(error), "the page shows {shown:?}, not the server's error {error:?}");
    for shot in ["turn-1.png", "turn-2-error.png", "turn-3.png"] {
        assert!(shots.join(shot).is_file(), "no screenshot {shot}");
    }
    let s: Value = read_json(&stats);
    assert!(u(&s, "read_failures") >= 1 && u(&s, "misses") > 0, "{s}");
    eprintln!("screenshots in {}", shots.display());
}
