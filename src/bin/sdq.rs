//! `sdq`: the project's own commands (model generation; more to come).

use clap::{Parser, Subcommand};
use sdq::genmodel::{self, Arch, GenOptions, ModelSpec};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "sdq", version, about = "Run MoE GGUF models larger than RAM with llama.cpp")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a MoE GGUF model with real quantized tensors and random weights.
    GenModel(GenModelArgs),
}

#[derive(clap::Args)]
struct GenModelArgs {
    /// Output file.
    #[arg(short, long)]
    out: PathBuf,
    /// Starting geometry: tiny (tens of MB) or 35b-a3b (the 35B-A3B target, ~21 GB).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Architecture: qwen35moe or qwen3moe (qwen3moe drops the shared expert and SSM layers).
    #[arg(long)]
    arch: Option<String>,
    #[arg(long)]
    layers: Option<u32>,
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
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Quantizer threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// GGUF whose tokenizer is copied (default: the vendored ggml-vocab-qwen35.gguf).
    #[arg(long)]
    vocab_file: Option<PathBuf>,
}

fn gen_model(a: GenModelArgs) -> sdq::Result<()> {
    let mut spec = ModelSpec::preset(&a.preset)?;
    if let Some(arch) = &a.arch {
        spec.arch = Arch::from_name(arch)?;
        if spec.arch == Arch::Qwen3Moe && a.shared_ff.is_none() {
            spec.n_ff_shexp = 0;
        }
    }
    macro_rules! set {
        ($($field:ident = $arg:ident),*) => { $(if let Some(v) = a.$arg { spec.$field = v; })* };
    }
    set!(n_layer = layers, n_embd = n_embd, n_head = heads, n_head_kv = kv_heads, head_dim = head_dim,
         n_expert = experts, n_expert_used = top_k, n_ff_exp = expert_ff, n_ff_shexp = shared_ff,
         n_vocab = vocab, context_length = context_length,
         full_attention_interval = full_attention_interval);
    spec.fused_gate_up |= a.fused_gate_up;
    spec.seed = a.seed;
    if let Some(t) = &a.expert_type {
        spec.expert_type = Some(
            sdq::ggml::GgmlType::from_name(t)
                .ok_or_else(|| sdq::Error::invalid(format!("unknown ggml type '{t}' for --expert-type")))?,
        );
    }
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let opts = GenOptions {
        out: a.out,
        vocab_file: a.vocab_file.unwrap_or_else(genmodel::default_vocab_file),
        threads,
        progress: true,
        preset: a.preset,
    };
    let report = genmodel::generate(&spec, &opts)?;
    println!(
        "wrote {} ({} bytes, {} tensors, {} {} layers, {} experts top-{}) in {:.1} s",
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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::GenModel(a) => gen_model(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sdq: error: {e}");
            ExitCode::FAILURE
        }
    }
}
