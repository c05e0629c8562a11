//! Images: a generated MiniCPM-V 4.6 projector (`sdq gen-model --mmproj`)
//! beside a generated qwen35moe model, run by llama-mtmd-cli on a small
//! generated PNG, with and without a budget.

use crate::util::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The text model and its projector (generated once per run).
pub(crate) fn vision_model() -> &'static (PathBuf, PathBuf) {
    static M: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    M.get_or_init(|| {
        let (model, mmproj) = (scratch().join("vision.gguf"), scratch().join("vision-mmproj.gguf"));
        let o = run(Command::new(bin("sdq")).args(["gen-model", "--layers", "4", "--seed", "5", "-o"]).arg(&model).arg("--mmproj").arg(&mmproj), 600);
        assert!(o.status.success(), "gen-model --mmproj: {}", stderr(&o));
        (model, mmproj)
    })
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// Writes a `w`×`h` RGB PNG of a colour pattern (zlib with stored blocks).
fn write_png(path: &Path, w: u32, h: u32) {
    let mut raw = Vec::new();
    for y in 0..h {
        raw.push(0); // filter: none
        for x in 0..w {
            raw.extend([(x * 7 + y * 3) as u8, (x * y) as u8, (255 - x) as u8]);
        }
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend((b.len() as u16).to_le_bytes());
        z.extend((!(b.len() as u16)).to_le_bytes());
        z.extend_from_slice(b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + x as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend(((b << 16) | a).to_be_bytes());
    let mut png = vec![0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];
    let mut chunk = |kind: &[u8], data: &[u8]| {
        png.extend((data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        png.extend_from_slice(&body);
        png.extend(crc32(&body).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &z);
    chunk(b"IEND", &[]);
    std::fs::write(path, png).unwrap();
}

pub(crate) fn image() -> PathBuf {
    let p = scratch().join("vision-pattern.png");
    if !p.exists() {
        write_png(&p, 64, 48);
    }
    p
}

/// llama-mtmd-cli with `model`, its projector `mmproj` and `image`, then `args`.
fn mtmd_cli(model: &Path, mmproj: &Path, image: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("llama-mtmd-cli"));
    cmd.arg("-m").arg(model).arg("--mmproj").arg(mmproj).arg("--image").arg(image).args(args);
    run(&mut cmd, 300)
}

/// llama-mtmd-cli on the image, greedy, with `extra` arguments: (stdout, stderr, status).
pub(crate) fn describe(extra: &[&str]) -> (String, String, Option<i32>) {
    let (model, mmproj) = vision_model();
    let o = mtmd_cli(model, mmproj, &image(), &[&["-p", "Describe the picture", "-n", "16", "--top-k", "1", "-t", "2"][..], extra].concat());
    (stdout(&o), stderr(&o), o.status.code())
}

#[test]
fn the_generated_projector_is_minicpmv_4_6_and_matches_its_text_model() {
    let (model, mmproj) = vision_model();
    let text = std::fs::read(model).unwrap();
    for token in ["<image>", "</image>", "<slice>", "</slice>"] {
        assert!(text.windows(token.len()).any(|w| w == token.as_bytes()), "the text model lacks {token}");
    }
    let p = std::fs::read(mmproj).unwrap();
    for needle in ["minicpmv4_6", "v.vit_merger.attn_q.weight", "mm.down.weight", "clip.vision.wa_layer_indexes"] {
        assert!(p.windows(needle.len()).any(|w| w == needle.as_bytes()), "the projector lacks {needle}");
    }
}

#[test]
fn an_image_prompt_gives_stocks_tokens_under_a_budget() {
    let (stock, err, code) = describe(&[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("encoding mtmd batch") || err.contains("image slice encoded") || err.contains("encoding image"), "no image was encoded:\n{err}");
    assert!(!stock.trim().is_empty());
    let stats = scratch().join("vision-stats.json");
    let (paged, err, code) = describe(&["--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(paged, stock, "an image prompt under a budget answered differently from stock");
    let s: serde_json::Value = read_json(&stats);
    assert_eq!(s["paged"], true, "{s}");
    assert_eq!(s["hit_rate"].as_f64(), Some(1.0), "every expert resident at 1 GiB: {s}");

    // The tightest budget this run takes, as the run itself states it (the
    // projector counted), plus 2 MiB: an arena of a few slots, which misses.
    let (_, err, code) = describe(&["--ram-budget", "160M"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("the projector {} takes", vision_model().1.display())), "{err}");
    let min = min_budget_in(&err);
    let budget = min + (2 << 20);
    let (paged, err, code) = describe(&["--ram-budget", &budget.to_string(), "--sdq-stats", stats.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(paged, stock, "an image prompt at a tight budget answered differently from stock");
    let s: serde_json::Value = read_json(&stats);
    assert!(s["misses"].as_u64().unwrap() > 0 && s["hit_rate"].as_f64().unwrap() < 0.9, "the arena was not tight: {s}");
    assert!(s["projector_weights_bytes"].as_u64().unwrap() > 4 << 20 && s["projector_compute_bytes"].as_u64().unwrap() > 0, "{s}");
    let peak = s["peak_rss_anon_bytes"].as_u64().unwrap();
    assert!(peak <= budget, "peak anonymous RSS {peak} over the budget {budget}: {s}");
}

/// "the minimum budget is 257.3 MiB" in sdq's error, in bytes (rounded up).
pub(crate) fn min_budget_in(err: &str) -> u64 {
    let rest = &err[err.find("the minimum budget is ").expect("a minimum budget in the error") + "the minimum budget is ".len()..];
    let mut words = rest.split_whitespace();
    let n: f64 = words.next().unwrap().parse().unwrap();
    let unit = match words.next().unwrap().trim_end_matches([',', ')', ';']) {
        "MiB" => 1u64 << 20,
        "GiB" => 1 << 30,
        u => panic!("unit {u} in {err}"),
    };
    ((n + 0.05) * unit as f64) as u64
}

#[test]
fn a_projector_for_another_model_and_an_unreadable_image_are_clear_errors() {
    let (model, _) = vision_model();
    let other = scratch().join("vision-512-mmproj.gguf");
    let o = run(
        Command::new(bin("sdq"))
            .args(["gen-model", "--layers", "4", "--n-embd", "512", "-o"])
            .arg(scratch().join("vision-512.gguf"))
            .arg("--mmproj")
            .arg(&other),
        600,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = mtmd_cli(model, &other, &image(), &["-p", "Hi", "-n", "2", "--ram-budget", "1G"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(stdout(&o).trim().is_empty(), "answered with a projector for another model: {}", stdout(&o));
    // Upstream logs it through common_log's worker thread and then calls
    // exit(1); the tool shim drains the log at exit so that the line is there.
    assert!(err.contains("mismatch between text model (n_embd = 256) and mmproj (n_embd = 512)"), "{err}");
    let bad = scratch().join("vision-not-a-png.png");
    std::fs::write(&bad, b"not a png").unwrap();
    for (path, says) in [(scratch().join("vision-missing.png"), "Unable to open file"), (bad.clone(), "failed to decode buffer")] {
        let (model, mmproj) = vision_model();
        let o = mtmd_cli(model, mmproj, &path, &["-p", "Hi", "-n", "2", "--ram-budget", "1G"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{}: {err}", path.display());
        // Upstream's message, then patch 0005's line naming the file.
        assert!(err.contains(says), "{}: {err}", path.display());
        assert!(err.contains(&format!("cannot load {} as an image, audio or video file", path.display())), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An OpenAI-style chat request with the image as a data URI: the answer's text.
fn chat_with_image(port: u16) -> String {
    let png = base64(&std::fs::read(image()).unwrap());
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"What is in this picture?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}}]}}],"max_tokens":12,"top_k":1,"temperature":0}}"#
    );
    let (status, body) = http(port, "POST", "/v1/chat/completions", Some(&body)).expect("request within its timeout");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content in {v}")).to_string()
}

#[test]
fn llama_server_answers_a_chat_request_with_an_image_under_a_budget() {
    let (model, mmproj) = vision_model();
    let common = ["-m", model.to_str().unwrap(), "--mmproj", mmproj.to_str().unwrap(), "-c", "2048", "-np", "1", "-t", "2", "--no-warmup"];
    let stock = {
        let (_server, port) = start_server(&common);
        chat_with_image(port)
    };
    assert!(!stock.is_empty());
    // The tightest budget the server takes (its own error says, projector
    // counted), plus 2 MiB: an arena of a few slots.
    let o = run(Command::new(bin("llama-server")).args(common).args(["--port", "0", "--ram-budget", "160M"]), 120);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let budget = (min_budget_in(&err) + (2 << 20)).to_string();
    let stats = scratch().join("vision-server-stats.json");
    let (_server, port) = start_server(&[&common[..], &["--ram-budget", &budget, "--sdq-stats", stats.to_str().unwrap()]].concat());
    assert_eq!(chat_with_image(port), stock, "an image chat under a budget answered differently from stock");

    // An image the server cannot decode is that request's error; the next
    // request is answered as stock answers it.
    let body = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"What is in this picture?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,bm90IGEgcG5n"}}]}],"max_tokens":4}"#;
    let (status, answer) = http(port, "POST", "/v1/chat/completions", Some(body)).expect("request within its timeout");
    assert!((400..500).contains(&status) && answer.contains("Failed to load image"), "{status}: {answer}");
    assert_eq!(chat_with_image(port), stock, "after a bad image");

    let s = stats_when(&stats, 30, "the pager's figures", |s| s["paged"] == true && u(s, "misses") > 0);
    assert!(s["hit_rate"].as_f64().unwrap() < 0.95, "the arena was not tight: {s}");
    assert!(u(&s, "peak_rss_anon_bytes") <= u(&s, "budget_bytes"), "{s}");
}

#[test]
fn sdq_inspect_counts_the_projector_before_the_arena() {
    let (model, mmproj) = vision_model();
    let inspect = |extra: &[&str]| {
        let o = run(Command::new(bin("sdq")).arg("inspect").arg(model).args(["--ram-budget", "1G", "--json"]).args(extra), 120);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str::<serde_json::Value>(&stdout(&o)).unwrap()
    };
    let text_only = inspect(&[]);
    let with = inspect(&["--mmproj", mmproj.to_str().unwrap()]);
    let p = &with["projector"];
    assert_eq!(p["projector_type"], "minicpmv4_6", "{p}");
    let weights = u(p, "weights_bytes");
    assert_eq!(weights, sdq::engine::model::gguf::Gguf::open(mmproj).unwrap().tensors().iter().map(|t| t.size).sum::<u64>());
    assert!(u(p, "compute_bytes") > 0, "{p}");
    let projector = weights + u(p, "compute_bytes");
    assert_eq!(u(&with["budget"], "projector_estimate_bytes"), projector);
    assert_eq!(u(&text_only["budget"], "arena_bytes") - u(&with["budget"], "arena_bytes"), projector, "{with}");

    let o = run(Command::new(bin("sdq")).arg("inspect").arg(model).arg("--mmproj").arg(model), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is not a projector (no clip.projector_type)"), "{}", stderr(&o));
}
