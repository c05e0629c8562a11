//! `sdq gen-model`'s flags and what they make: a [`ModelSpec`] from a
//! preset with the flags over it, and the files written from it.

use super::{Arch, GenOptions, ModelSpec};
use crate::error::{Error, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct GenModelArgs {
    /// Output file.
    #[arg(short, long)]
    out: PathBuf,
    /// Starting geometry: tiny (tens of MB), 35b-a3b (the 35B-A3B target,
    /// ~21 GB), gpt-oss-120b (~64 GB, MXFP4 experts), gpt-oss-20b (~13 GB)
    /// or deepseek-v3 (~400 GB at Q4_K_M's rule; cut it with --layers).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Architecture family: qwen35moe, qwen3moe, qwen3next, gpt-oss, deepseek2, glm4moe,
    /// gemma4 or llama (Mixtral); each brings its own tensors, metadata and defaults.
    #[arg(long)]
    arch: Option<String>,
    /// Layers (a preset's depth cut to N; state the cut with the figures).
    #[arg(long)]
    layers: Option<u32>,
    /// Leading layers with a dense FFN instead of experts (deepseek2, glm4moe).
    #[arg(long)]
    dense_layers: Option<u32>,
    /// NextN (multi-token prediction) blocks after the last layer, as
    /// Qwen3.5/3.6 and GLM ship them: 0 or 1 (qwen35moe, glm4moe; the
    /// family's default otherwise). llama.cpp loads one only for
    /// `--spec-type draft-mtp`.
    #[arg(long)]
    nextn: Option<u32>,
    #[arg(long)]
    n_embd: Option<i64>,
    /// Attention heads (and --kv-heads, --head-dim).
    #[arg(long)]
    heads: Option<i64>,
    #[arg(long)]
    kv_heads: Option<i64>,
    #[arg(long)]
    head_dim: Option<i64>,
    /// Routed experts per layer.
    #[arg(long)]
    experts: Option<i64>,
    /// Experts used per token.
    #[arg(long)]
    top_k: Option<i64>,
    /// Width of one routed expert's FFN.
    #[arg(long)]
    expert_ff: Option<i64>,
    /// Width of the shared expert's FFN (0: none).
    #[arg(long)]
    shared_ff: Option<i64>,
    /// Vocabulary size (at least the tokenizer's 151,936; the rest is padding).
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long)]
    context_length: Option<u32>,
    /// qwen35moe: layer i is full attention iff (i + 1) % N == 0, the rest linear attention.
    #[arg(long)]
    full_attention_interval: Option<u32>,
    /// Write gate and up experts as one fused ffn_gate_up_exps tensor.
    #[arg(long)]
    fused_gate_up: bool,
    /// Type of all routed-expert tensors (e.g. q8_0, q4_0, q5_K) instead of the Q4_K_M rule.
    #[arg(long)]
    expert_type: Option<String>,
    /// Router preference for some experts: 0 = near-uniform routing (the worst case
    /// for a cache), 2 = trained-looking hot and cold experts.
    #[arg(long, allow_negative_numbers = true)]
    router_skew: Option<f32>,
    /// How much of the earlier tokens the hidden states (and so the routers)
    /// carry: the scale of the attention output projections, 0.15 by default.
    #[arg(long)]
    context_gain: Option<f32>,
    /// How strongly attention favours the last few tokens, so that a token
    /// reuses some of its neighbours' experts as trained models do (0, the
    /// default: not at all).
    #[arg(long)]
    recency: Option<f32>,
    /// How much of the previous tokens' routing input each attention layer
    /// carries forward, so that neighbouring tokens share experts (0, the
    /// default: none).
    #[arg(long)]
    carry: Option<f32>,
    /// Routing as a whole: `skewed` (the default: --router-skew 2, hot and
    /// cold experts, little reuse between neighbouring tokens) or `trained`
    /// (the architecture's skew, context gain, recency and carry calibrated
    /// against a trained model's routing trace); --router-skew,
    /// --context-gain, --recency and --carry given beside it win.
    #[arg(long, default_value = "skewed")]
    routing: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Quantizer threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// GGUF whose tokenizer is copied (default: the vendored ggml-vocab-qwen35.gguf,
    /// or ggml-vocab-deepseek-llm.gguf for a vocabulary smaller than its 151,936).
    #[arg(long)]
    vocab_file: Option<PathBuf>,
    /// Write the model in parts of at most SIZE of tensor data each, named
    /// and keyed as `llama-gguf-split --split-max-size` writes them
    /// (OUT-00001-of-0000N.gguf); llama.cpp is given the first.
    #[arg(long)]
    split_max_size: Option<String>,
    /// Also write a MiniCPM-V 4.6 vision projector for this model here (the
    /// model then gets the image tokens its template needs).
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// Also write a LoRA adapter for this model here (`--lora` loads it): it
    /// adapts the attention layers' value projections and the MoE layers'
    /// up experts.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// The adapter's rank.
    #[arg(long, default_value_t = super::lora::DEFAULT_RANK)]
    lora_rank: i64,
    /// The projector's vision tower: small (5 MB) or so400m (SigLIP-so400m,
    /// ~0.9 GB, the real one's size); default: so400m for --preset 35b-a3b.
    #[arg(long)]
    mmproj_size: Option<String>,
}

/// `sdq gen-model`: the flags over the preset's spec, checked before any
/// file is written; then the model, and the projector and adapter asked
/// for, each with one line of what was written.
pub fn run(a: GenModelArgs) -> Result<()> {
    let mut spec = ModelSpec::preset(&a.preset)?;
    if let Some(arch) = &a.arch {
        let arch = Arch::from_name(arch)?;
        if ModelSpec::preset_is_a_model(&a.preset) && arch != spec.arch {
            return Err(Error::flag("--arch", format!("--arch {} conflicts with --preset {}, which is a {} model", arch.name(), a.preset, spec.arch.name())));
        }
        if arch != spec.arch {
            spec.set_arch(arch);
        }
    }
    macro_rules! set {
        ($($field:ident = $arg:ident),*) => { $(if let Some(v) = a.$arg { spec.$field = v; })* };
    }
    set!(
        n_layer = layers,
        n_embd = n_embd,
        n_head = heads,
        n_head_kv = kv_heads,
        head_dim = head_dim,
        n_expert = experts,
        n_expert_used = top_k,
        n_ff_exp = expert_ff,
        n_ff_shexp = shared_ff,
        n_vocab = vocab,
        context_length = context_length,
        full_attention_interval = full_attention_interval,
        n_layer_dense_lead = dense_layers,
        n_nextn = nextn
    );
    spec.fused_gate_up |= a.fused_gate_up;
    spec.seed = a.seed;
    match a.routing.as_str() {
        "skewed" => {}
        "trained" => (spec.router_skew, spec.context_gain, spec.recency, spec.carry) = spec.trained_routing(),
        other => return Err(Error::flag("--routing", format!("--routing '{other}' is not skewed or trained"))),
    }
    // Given beside --routing, they win.
    set!(router_skew = router_skew, context_gain = context_gain, recency = recency, carry = carry);
    if let Some(t) = &a.expert_type {
        spec.expert_type = Some(
            crate::engine::ffi::ggml::GgmlType::from_name(t)
                .ok_or_else(|| Error::flag("--expert-type", format!("unknown ggml type '{t}' for --expert-type")))?,
        );
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let vocab_file = a.vocab_file.unwrap_or_else(|| super::vocab_file_for(spec.n_vocab));
    if a.mmproj.is_some() && a.vocab.is_none() {
        // Room for the image tokens after the tokenizer's own.
        let n_tokens = crate::engine::model::gguf::Gguf::open(&vocab_file)?.get("tokenizer.ggml.tokens").map_or(0, |v| match v {
            crate::engine::model::gguf::Value::Array(a) => a.len(),
            _ => 0,
        });
        spec.n_vocab = spec.n_vocab.max(n_tokens + super::IMAGE_TOKENS.len());
    }
    let split_max_bytes = match &a.split_max_size {
        Some(s) => match crate::units::parse_size(s) {
            Ok(0) | Err(_) => return Err(Error::flag("--split-max-size", format!("--split-max-size: '{s}' is not a size (e.g. 50G, 4000M)"))),
            Ok(n) => Some(n),
        },
        None => None,
    };
    // Before the model is written, not after.
    super::lora::check_rank(a.lora_rank)?;
    if split_max_bytes.is_some() && a.mmproj.is_some() {
        return Err(Error::flag("--split-max-size", "--split-max-size and --mmproj: a projector is one file; generate it apart".to_string()));
    }
    let opts = GenOptions { out: a.out, vocab_file, threads, progress: true, preset: a.preset, image_tokens: a.mmproj.is_some(), split_max_bytes };
    let size = a.mmproj_size.as_deref().unwrap_or(super::Projector::default_for(&opts.preset));
    super::Projector::named(size, &spec)?; // before the text model is written
    let report = super::generate(&spec, &opts)?;
    if let Some(path) = &a.mmproj {
        let r = super::generate_mmproj(&spec, &GenOptions { out: path.clone(), ..opts.clone() }, size)?;
        println!("wrote {} ({} bytes, {} tensors, MiniCPM-V 4.6 projector, {size} tower) in {:.1} s", r.path.display(), r.bytes, r.tensors, r.seconds);
    }
    if let Some(path) = &a.lora {
        let r = super::generate_lora(&spec, &GenOptions { out: path.clone(), split_max_bytes: None, ..opts.clone() }, a.lora_rank)?;
        println!("wrote {} ({} bytes, {} tensors, LoRA adapter of rank {}) in {:.1} s", r.path.display(), r.bytes, r.tensors, a.lora_rank, r.seconds);
    }
    let parts = if report.parts.len() > 1 { format!(", {} parts", report.parts.len()) } else { String::new() };
    println!(
        "wrote {} ({} bytes{parts}, {} tensors, {} {} layers, {} experts top-{}) in {:.1} s",
        report.path.display(),
        report.bytes,
        report.tensors,
        spec.arch.name(),
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used,
        report.seconds
    );
    Ok(())
}
