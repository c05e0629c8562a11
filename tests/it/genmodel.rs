//! Models written by `sdq gen-model`: the file's metadata says what the spec
//! says, the llama.cpp tools load them, and the output is deterministic.

use crate::util::*;
use sdq::engine::ffi::ggml::GgmlType;
use sdq::engine::model::gguf::{Array, Gguf, Value};
use std::process::Command;

/// Q4_K_M's `use_more_bits`, written out again here so the test does not
/// trust the generator's copy.
fn more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

fn tensor<'a>(ts: &'a [sdq::engine::model::gguf::TensorInfo], name: &str) -> &'a sdq::engine::model::gguf::TensorInfo {
    ts.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
}

#[test]
fn tiny_has_the_qwen35moe_layout() {
    let g = Gguf::open(tiny_preset()).unwrap();
    assert_eq!(g.get("general.architecture"), Some(Value::Str("qwen35moe".into())));
    assert_eq!(g.get("qwen35moe.block_count").and_then(|v| v.as_u64()), Some(8));
    // Full attention every 4th layer: layers 3 and 7.
    let expect: Vec<bool> = (0..8).map(|i| (i + 1) % 4 != 0).collect();
    assert_eq!(g.get("qwen35moe.attention.recurrent_layers"), Some(Value::Array(Array::Bool(expect))));
    match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => assert_eq!(a.len(), 151_936),
        other => panic!("tokens: {other:?}"),
    }
    assert_eq!(g.get("tokenizer.ggml.pre"), Some(Value::Str("qwen35".into())));

    let ts = g.tensors();
    for il in 0..8 {
        let down = tensor(&ts, &format!("blk.{il}.ffn_down_exps.weight"));
        let want = if more_bits(il, 8) { GgmlType::Q6_K } else { GgmlType::Q4_K };
        assert_eq!(down.ty, want, "layer {il} down type");
        assert_eq!(down.ne, [256, 256, 16, 1]);
        for gu in ["gate", "up"] {
            let t = tensor(&ts, &format!("blk.{il}.ffn_{gu}_exps.weight"));
            assert_eq!((t.ty, t.ne), (GgmlType::Q4_K, [256, 256, 16, 1]), "layer {il} {gu}");
        }
        let recurrent = (il + 1) % 4 != 0;
        assert_eq!(ts.iter().any(|t| t.name == format!("blk.{il}.ssm_a")), recurrent, "layer {il} ssm");
        assert_eq!(ts.iter().any(|t| t.name == format!("blk.{il}.attn_q.weight")), !recurrent, "layer {il} attn");
    }
    // Layers 0, 3, 6, 7 have Q6_K down projections: two expert sizes.
    let sizes: std::collections::BTreeSet<u64> = (0..8).map(|il| tensor(&ts, &format!("blk.{il}.ffn_down_exps.weight")).size / 16).collect();
    assert_eq!(sizes.len(), 2, "expert down sizes {sizes:?}");
    // Tensors lie inside the file, aligned, without overlap.
    let len = std::fs::metadata(tiny_preset()).unwrap().len();
    let mut spans: Vec<(u64, u64)> = ts.iter().map(|t| (t.offset, t.offset + t.size)).collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0) && spans.last().unwrap().1 <= len);
    assert!(ts.iter().all(|t| t.offset % g.alignment() == 0));
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let a = std::fs::read(tiny_preset()).unwrap();
    // Into a directory that does not exist yet: gen-model makes it.
    let _ = std::fs::remove_dir_all(scratch().join("new-dir"));
    let b = std::fs::read(gen_model("new-dir/tiny-again.gguf", &["--preset", "tiny", "--seed", "1", "--threads", "1"])).unwrap();
    std::fs::remove_dir_all(scratch().join("new-dir")).unwrap();
    assert!(a == b, "same seed, different files (thread count must not matter)");
    let c = std::fs::read(gen_model("tiny-seed2.gguf", &["--preset", "tiny", "--seed", "2"])).unwrap();
    assert_eq!(a.len(), c.len());
    assert!(a != c, "seed does not change the weights");
}

#[test]
fn fused_gate_up_loads_and_runs() {
    let m = gen_model("tiny-fused.gguf", &["--preset", "tiny", "--fused-gate-up", "--layers", "4"]);
    let ts = Gguf::open(&m).unwrap().tensors();
    let t = tensor(&ts, "blk.0.ffn_gate_up_exps.weight");
    assert_eq!(t.ne, [256, 512, 16, 1]);
    assert!(!ts.iter().any(|t| t.name.contains("ffn_gate_exps")));
    let o = run(Command::new(bin("llama-completion")).args(completion_args(&m, "Hello world", 8)), 300);
    assert!(o.status.success(), "fused model does not run:\n{}", stderr(&o));
}

#[test]
fn qwen3moe_loads_and_runs() {
    let m = gen_model("tiny-qwen3moe.gguf", &["--preset", "tiny", "--arch", "qwen3moe", "--layers", "4", "--experts", "8", "--top-k", "2"]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get("general.architecture"), Some(Value::Str("qwen3moe".into())));
    assert!(!g.tensors().iter().any(|t| t.name.contains("shexp") || t.name.contains("ssm_")));
    let o = run(Command::new(bin("llama-completion")).args(completion_args(&m, "Hello world", 8)), 300);
    assert!(o.status.success(), "qwen3moe model does not run:\n{}", stderr(&o));
}

#[test]
fn other_expert_types_load() {
    for ty in ["q8_0", "q4_0"] {
        let m = gen_model(&format!("tiny-{ty}.gguf"), &["--preset", "tiny", "--layers", "4", "--expert-type", ty]);
        let ts = Gguf::open(&m).unwrap().tensors();
        assert_eq!(tensor(&ts, "blk.1.ffn_down_exps.weight").ty, GgmlType::from_name(ty).unwrap());
        let o = run(Command::new(bin("llama-completion")).args(completion_args(&m, "Hi", 4)), 300);
        assert!(o.status.success(), "{ty} experts do not run:\n{}", stderr(&o));
    }
}

#[test]
fn the_35b_a3b_geometry_from_a_one_layer_file() {
    // The full file is ~21 GB; one layer of the same geometry checks the
    // per-layer shapes and types from a real file's metadata.
    let m = TempModel::generate("35b-a3b-1layer.gguf", &["--preset", "35b-a3b", "--layers", "1", "--full-attention-interval", "1"]);
    let g = Gguf::open(&m).unwrap();
    let ts = g.tensors();
    assert_eq!(tensor(&ts, "token_embd.weight").ne, [2048, 248_320, 1, 1]);
    assert_eq!(tensor(&ts, "output.weight").ty, GgmlType::Q6_K);
    let gate = tensor(&ts, "blk.0.ffn_gate_exps.weight");
    assert_eq!((gate.ty, gate.ne, gate.size), (GgmlType::Q4_K, [2048, 512, 256, 1], 589_824 * 256));
    let down = tensor(&ts, "blk.0.ffn_down_exps.weight");
    assert_eq!((down.ty, down.ne, down.size), (GgmlType::Q6_K, [512, 2048, 256, 1], 860_160 * 256));
    match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => assert_eq!(a.len(), 248_320),
        other => panic!("tokens: {other:?}"),
    }
    for (k, v) in [("expert_count", 256), ("expert_used_count", 8), ("embedding_length", 2048), ("expert_feed_forward_length", 512)] {
        assert_eq!(g.get(&format!("qwen35moe.{k}")).and_then(|x| x.as_u64()), Some(v), "{k}");
    }
}

#[test]
fn bad_geometry_is_a_clear_error() {
    for (args, needle) in [
        (&["--experts", "4", "--top-k", "8"][..], "top-k 8 of 4 experts"),
        (&["--n-embd", "100"][..], "n_embd 100"),
        (&["--layers", "2"][..], "without any attention layer"),
        (&["--preset", "huge"][..], "unknown preset 'huge'"),
        (&["--vocab", "1000"][..], "smaller than the tokenizer"),
        (&["--expert-type", "q9_9"][..], "unknown ggml type 'q9_9'"),
        (&["--router-skew", "-1"][..], "router skew -1 is outside 0..=16"),
        (&["--recency", "20"][..], "recency 20 is outside 0..=16"),
        (&["--carry", "20"][..], "carry 20 is outside 0..=16"),
        (&["--arch", "deepseek2", "--carry", "2"][..], "carry 2 needs attention with its own value projection, which deepseek2's latent"),
        (&["--arch", "gpt-oss", "--nextn", "1"][..], "1 NextN blocks on gpt-oss: llama.cpp reads at most one, on qwen35moe or glm4moe only"),
        (&["--nextn", "2"][..], "2 NextN blocks on qwen35moe: llama.cpp reads at most one"),
        (&["--routing", "learned"][..], "--routing 'learned' is not skewed or trained"),
        (&["--preset", "gpt-oss-120b", "--arch", "qwen35moe"][..], "--arch qwen35moe conflicts with --preset gpt-oss-120b"),
        (&["--preset", "deepseek-v3", "--layers", "2"][..], "3 leading dense layers are more than the 2 layers"),
        (&["--split-max-size", "0"][..], "--split-max-size: '0' is not a size"),
        (&["--preset", "gpt-oss-120b", "--expert-type", "q4_K"][..], "expert rows of 2880 are not a multiple of q4_K's block of 256"),
    ] {
        let out = scratch().join("bad.gguf");
        let o = run(Command::new(bin("sdq")).arg("gen-model").args(args).arg("-o").arg(&out), 60);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
        assert!(!out.exists(), "{args:?} left a file behind");
    }
}

#[test]
fn a_disk_too_small_for_the_model_is_refused_before_writing() {
    // An 8 MiB tmpfs in a private mount namespace stands for a full disk;
    // the tiny model is 74 MB, so nothing of it may be written.
    let dir = scratch().join("small-disk");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("m.gguf");
    let script = format!(
        "mount -t tmpfs -o size=8m sdq-test {d} && {sdq} gen-model --preset tiny -o {o}; rc=$?; ls {d}; exit $rc",
        d = dir.display(),
        sdq = bin("sdq").display(),
        o = out.display()
    );
    let o = run(Command::new("unshare").args(["-m", "sh", "-c", &script]), 60);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("not enough free space for {}", out.display())) && err.contains("has 8.0 MiB free"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "", "gen-model left a file behind");
}

/// A model written in parts loads as the whole file does: same tokens.
#[test]
fn a_model_written_in_parts_runs_as_the_whole_file() {
    let whole = TempModel::generate("parts-whole.gguf", &["--preset", "tiny", "--layers", "4", "--seed", "5"]);
    let o = run(
        Command::new(bin("sdq"))
            .args(["gen-model", "--preset", "tiny", "--layers", "4", "--seed", "5", "--split-max-size", "20M", "-o"])
            .arg(scratch().join("parts.gguf")),
        120,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let parts: Vec<TempModel> = std::fs::read_dir(scratch())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("parts-0"))
        .map(TempModel::adopt)
        .collect();
    assert!(parts.len() >= 3, "{} parts", parts.len());
    let first = parts.iter().find(|p| p.to_string_lossy().contains("-00001-of-")).expect("a first part");
    let tokens = |m: &std::path::Path| {
        let o = run(Command::new(bin("sdq")).args(["eval", "-m", m.to_str().unwrap(), "-p", "The river ran", "-n", "8", "-c", "256"]), 120);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(tokens(first), tokens(&whole));
}
