//! Every MoE family the generator writes, paged against stock llama.cpp with
//! the same flags: identical greedy tokens and final logits at the minimum
//! arena, a middle one and one holding every expert.

use crate::pager::{budget_for, eval, eval_env, max_abs_diff, MIB};
use crate::util::*;
use serde_json::Value;
use std::path::PathBuf;

/// One family's test model: the name of its file, `sdq gen-model` options,
/// its routed experts per layer and the layers the loader pages (NextN
/// blocks are skipped unless MTP drafting is asked for).
struct Case {
    name: &'static str,
    args: &'static [&'static str],
    experts: u64,
    paged_layers: u64,
}

const CASES: &[Case] = &[
    Case { name: "qwen35moe", args: &["--arch", "qwen35moe"], experts: 16, paged_layers: 4 },
    Case { name: "qwen3moe", args: &["--arch", "qwen3moe"], experts: 16, paged_layers: 4 },
    Case { name: "qwen3next", args: &["--arch", "qwen3next"], experts: 16, paged_layers: 4 },
    Case { name: "gpt-oss", args: &["--arch", "gpt-oss"], experts: 16, paged_layers: 4 },
    Case { name: "gpt-oss-mxfp4", args: &["--arch", "gpt-oss", "--expert-type", "mxfp4"], experts: 16, paged_layers: 4 },
    // One dense leading layer; grouped sigmoid routing with exp_probs_b.
    Case { name: "deepseek2", args: &["--arch", "deepseek2"], experts: 16, paged_layers: 3 },
    Case { name: "deepseek2-fused", args: &["--arch", "deepseek2", "--fused-gate-up"], experts: 16, paged_layers: 3 },
    // Routing calibrated to a trained model's (recency in the queries and
    // keys: for gpt-oss and DeepSeek, its own fills of q/k and MLA's
    // q_a/q_b/kv_a; carry in qwen35moe's and gpt-oss's first attention
    // layer's values and output, a routing subspace, and an output head blind to it).
    Case { name: "qwen35moe-trained", args: &["--arch", "qwen35moe", "--routing", "trained"], experts: 16, paged_layers: 4 },
    Case { name: "gpt-oss-trained", args: &["--arch", "gpt-oss", "--routing", "trained"], experts: 16, paged_layers: 4 },
    Case { name: "deepseek2-trained", args: &["--arch", "deepseek2", "--routing", "trained"], experts: 16, paged_layers: 3 },
    // One dense leading layer and a NextN block that llama.cpp skips.
    Case { name: "glm4moe", args: &["--arch", "glm4moe"], experts: 16, paged_layers: 3 },
    Case { name: "gemma4", args: &["--arch", "gemma4"], experts: 16, paged_layers: 4 },
    Case { name: "llama", args: &["--arch", "llama"], experts: 8, paged_layers: 4 },
];

/// The family's 4-layer model (with the tests' small vocabulary), generated
/// once per run.
pub fn family_model(name: &str) -> PathBuf {
    let case = CASES.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no family case {name}"));
    let file = format!("family-{name}.gguf");
    let path = scratch().join(&file);
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        gen_model(&file, &small_vocab(&[case.args, &["--layers", "4", "--seed", "7"]].concat()));
    }
    path
}

fn paged_layers(stats: &Value) -> u64 {
    stats["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "layers")).sum()
}

fn check_family(case: &Case) {
    let model = family_model(case.name);
    let prompt = "The river ran past the old mill, under the stone bridge where children watched the boats";
    let reserve = 16 * MIB;
    for (flags, extra) in [("defaults", &[][..]), ("no-repack", &["--no-repack"][..])] {
        let base = [&["-p", prompt, "-n", "20", "-t", "2", "-c", "512"][..], extra].concat();
        let stock = eval(&model, &format!("{}-stock-{flags}", case.name), &base);
        let probe = eval(&model, &format!("{}-probe-{flags}", case.name), &[&base[..], &["--ram-budget", "2G", "--sdq-reserve", "16M"]].concat());
        let stats = probe.stats.unwrap();
        assert_eq!(paged_layers(&stats), case.paged_layers, "{}: paged layers: {stats}", case.name);
        let (all, min) = (all_arena(&stats, case.experts), min_arena(&stats));
        // --no-repack is checked at the tightest arena only: the layouts are
        // the same code for every family, the families' graphs are not.
        let arenas: &[(&str, u64)] = if extra.is_empty() { &[("all", all), ("middle", all / 3), ("minimum", min + MIB)] } else { &[("minimum", min + MIB)] };
        for &(name, arena) in arenas {
            let budget = budget_for(&stats, reserve, arena);
            let what = format!("{}: {name} arena, {flags}", case.name);
            let run = eval(&model, &format!("{}-{name}-{flags}", case.name), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "16M"]].concat());
            assert_eq!(run.json["tokens"], stock.json["tokens"], "{what}: tokens differ from stock");
            assert_eq!(max_abs_diff(&run.logits, &stock.logits), 0.0, "{what}: logits differ");
            let s = run.stats.as_ref().unwrap();
            assert!(sanitized() || u(s, "peak_rss_anon_bytes") <= budget.parse().unwrap(), "{what}: peak RSS over budget: {s}");
            if name == "minimum" {
                assert!(u(s, "misses") > 0, "{what}: a minimum arena must miss: {s}");
            }
        }
    }
    check_grouped_prompt(case, &model);
}

/// A prompt of several ubatches given to one llama_decode, computed layer by
/// layer across them (patch 0013) at an arena that holds a layer's experts
/// but not the model's: the same tokens and logits as stock with the same
/// flags, the KV cache, recurrent state and sliding windows crossing the
/// ubatches as in stock's order. And again with the group's expert ops
/// shared (`SDQ_GROUP_SHARE=1`, the default where the arena holds less than
/// a layer): each layer whose experts are one op computed for every ubatch
/// in the first's, from the inputs the others kept aside.
/// The families whose paged layers are three matmuls, not one op for the
/// layer (`hooks::moe_experts` takes only plain SwiGLU without biases)
/// (gpt-oss's biased, clamped SwiGLU; gemma4's GELU; a fused gate_up).
const NOT_FUSED: &[&str] = &["gpt-oss", "gpt-oss-mxfp4", "gpt-oss-trained", "gemma4", "deepseek2-fused"];

fn check_grouped_prompt(case: &Case, model: &std::path::Path) {
    let prompt = crate::pager::long_prompt();
    let base = ["--prompt-file", prompt.to_str().unwrap(), "-n", "8", "-t", "2", "-c", "1024", "--ubatch", "96", "--batch", "1024"];
    let stock = eval(model, &format!("{}-grouped-stock", case.name), &base);
    // -b does not change a value: the ubatches are the same whether the
    // prompt comes in one llama_decode or in one a ubatch.
    let batch_of_one_ubatch = [&base[..10], &["--batch", "96"]].concat();
    let stock_small_b = eval(model, &format!("{}-grouped-stock-b96", case.name), &batch_of_one_ubatch);
    assert_eq!(stock_small_b.json["tokens"], stock.json["tokens"], "{}: stock's tokens depend on -b", case.name);
    assert_eq!(max_abs_diff(&stock_small_b.logits, &stock.logits), 0.0, "{}: stock's logits depend on -b", case.name);
    let probe = eval(model, &format!("{}-grouped-probe", case.name), &[&base[..], &["--ram-budget", "2G", "--sdq-reserve", "64M"]].concat());
    let stats = probe.stats.unwrap();
    let (all, layer) = (all_arena(&stats, case.experts), all_arena(&stats, case.experts) / case.paged_layers);
    let budget = budget_for(&stats, 64 * MIB, (all / 2).max(layer * 2));
    let what = format!("{}: a grouped prompt", case.name);
    let run = eval(model, &format!("{}-grouped", case.name), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "64M"]].concat());
    assert_eq!(run.json["tokens"], stock.json["tokens"], "{what}: tokens differ from stock");
    assert_eq!(max_abs_diff(&run.logits, &stock.logits), 0.0, "{what}: logits differ");
    let s = run.stats.as_ref().unwrap();
    let (groups, ubatches) = (u(&s["prompt_groups"], "groups"), u(&s["prompt_groups"], "ubatches"));
    assert!(groups >= 1 && ubatches >= 6 && ubatches >= 2 * groups, "{what}: not computed in groups of several ubatches: {s}");
    let what = format!("{}: a grouped prompt, its expert ops shared", case.name);
    let shared = eval_env(
        model,
        &format!("{}-grouped-shared", case.name),
        &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "64M"]].concat(),
        &[("SDQ_GROUP_SHARE", "1")],
    );
    assert_eq!(shared.json["tokens"], stock.json["tokens"], "{what}: tokens differ from stock");
    assert_eq!(max_abs_diff(&shared.logits, &stock.logits), 0.0, "{what}: logits differ");
    let s = shared.stats.as_ref().unwrap();
    let g = &s["prompt_groups"];
    // Layers of three matmuls (gpt-oss's biased, clamped SwiGLU) compute
    // their down's input inside the piece: those groups do not share.
    let fused = !NOT_FUSED.contains(&case.name);
    // A last layer computes the prompt's output tokens only: where it is
    // paged, the group's first ubatch (no output) computes nothing there,
    // and the last ubatch its own token.
    let (groups, layers) = (u(g, "groups"), u(g, "shared_layers"));
    let shared_all = if fused { (groups * (case.paged_layers - 1)..=groups * case.paged_layers).contains(&layers) } else { layers == 0 };
    assert!(groups >= 1 && u(g, "shared") == u64::from(fused) * groups && shared_all, "{what}: not every paged layer of every group shared: {s}");
}

macro_rules! family_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                check_family(CASES.iter().find(|c| c.name == $name).unwrap());
            }
        )*
    };
}

family_tests! {
    qwen35moe_is_identical_to_stock => "qwen35moe",
    qwen3moe_is_identical_to_stock => "qwen3moe",
    qwen3next_is_identical_to_stock => "qwen3next",
    gpt_oss_is_identical_to_stock => "gpt-oss",
    gpt_oss_with_mxfp4_experts_is_identical_to_stock => "gpt-oss-mxfp4",
    deepseek2_is_identical_to_stock => "deepseek2",
    deepseek2_with_fused_gate_up_is_identical_to_stock => "deepseek2-fused",
    qwen35moe_with_trained_routing_is_identical_to_stock => "qwen35moe-trained",
    gpt_oss_with_trained_routing_is_identical_to_stock => "gpt-oss-trained",
    deepseek2_with_trained_routing_is_identical_to_stock => "deepseek2-trained",
    glm4moe_with_a_nextn_block_is_identical_to_stock => "glm4moe",
    gemma4_is_identical_to_stock => "gemma4",
    mixtral_is_identical_to_stock => "llama",
}

/// The generator writes each family's own metadata and tensor names.
#[test]
fn each_family_has_its_own_keys_and_tensors() {
    let expect: &[(&str, &[&str], &[&str])] = &[
        (
            "gpt-oss",
            &["gpt-oss.attention.sliding_window"],
            &["blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_down_exps.bias", "blk.0.ffn_gate_inp.bias"],
        ),
        (
            "deepseek2",
            &["deepseek2.attention.kv_lora_rank", "deepseek2.expert_group_count", "deepseek2.leading_dense_block_count", "deepseek2.expert_shared_count"],
            &["blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.attn_k_b.weight", "blk.1.ffn_down_shexp.weight"],
        ),
        ("glm4moe", &["glm4moe.nextn_predict_layers"], &["blk.4.nextn.eh_proj.weight", "blk.4.ffn_down_exps.weight", "blk.1.attn_q.bias"]),
        (
            "gemma4",
            &["gemma4.attention.sliding_window_pattern"],
            &["blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_exps.scale", "blk.0.ffn_gate_inp.scale", "rope_freqs.weight"],
        ),
        ("qwen3next", &["qwen3next.ssm.inner_size"], &["blk.0.ssm_ba.weight", "blk.3.attn_q_norm.weight"]),
        ("llama", &["llama.expert_count"], &["blk.0.ffn_norm.weight", "blk.0.ffn_gate_exps.weight"]),
    ];
    for (name, keys, tensors) in expect {
        let g = sdq::engine::model::gguf::Gguf::open(&family_model(name)).unwrap();
        assert_eq!(g.get("general.architecture").and_then(|v| v.as_str().map(str::to_string)).as_deref(), Some(*name));
        for k in keys.iter() {
            assert!(g.get(k).is_some(), "{name}: no key {k}");
        }
        let names: Vec<String> = g.tensors().into_iter().map(|t| t.name).collect();
        for t in tensors.iter() {
            assert!(names.iter().any(|n| n == t), "{name}: no tensor {t}");
        }
    }
}
