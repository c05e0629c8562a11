//! `sdq`: the project's own commands (`demo`, `gen-model`, `inspect`,
//! `replay`, `limit`, `eval`, `bench-disk`): each one's arguments and the
//! few lines that call its module in `src/commands/`.
//!
//! `gen-model`'s flags live with it (`commands::genmodel::GenModelArgs`):
//! there are thirty, and turning them into a model's spec is its logic.

use clap::{Parser, Subcommand};
use sdq::commands::genmodel;
use sdq::stderr_line;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "sdq", version = sdq::host::tools::VERSION, about = "Run MoE GGUF models larger than RAM with llama.cpp")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a MoE GGUF model with real quantized tensors and random weights.
    GenModel(Box<genmodel::GenModelArgs>),
    /// The main job on a built-in default: a generated ~4.8 GB MoE model run
    /// greedily in a 1.5 GiB RAM budget, checked against stock llama.cpp.
    Demo(DemoArgs),
    /// A model's memory accounting from its metadata (and, with --ram-budget,
    /// how that budget would be split).
    Inspect(InspectArgs),
    /// Run a command inside an enforced memory limit (a memory cgroup with no
    /// swap, page cache counted) and report peak usage, OOM kills, major
    /// faults and swap; or, with --pid, change a running process's limit.
    Limit(LimitArgs),
    /// Greedy decoding through llama.h, printing tokens and text as JSON and
    /// optionally the final logits (to compare a budgeted run with stock).
    Eval(EvalArgs),
    /// Replay a routing trace (`--sdq-trace`) through the pager's slot plan
    /// and eviction policies at other arena sizes, with the offline optimum
    /// (Bélády) as the bound: hit % over all steps and decode steps only.
    Replay(ReplayArgs),
    /// Measure the disk under a file as the pager reads it: random reads of
    /// expert-sized blocks at queue depths, buffered and O_DIRECT, and one
    /// sequential stream (JSON lines; scripts/bench-disk.py tabulates them).
    BenchDisk(BenchDiskArgs),
}

#[derive(clap::Args)]
struct BenchDiskArgs {
    /// A large file on the disk to measure (the model).
    file: PathBuf,
    /// Read sizes.
    #[arg(long, value_delimiter = ',', default_value = "512K,1M,2M")]
    sizes: Vec<String>,
    /// Reads in flight (one thread each).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    depths: Vec<usize>,
    /// Modes: buffered, direct, sequential.
    #[arg(long, value_delimiter = ',', default_value = "sequential,buffered,direct")]
    modes: Vec<String>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
}

fn bench_disk(a: BenchDiskArgs) -> sdq::Result<()> {
    use sdq::commands::diskbench::{measure, Mode};
    let sizes = a
        .sizes
        .iter()
        .map(|s| sdq::units::parse_size(s).map(|n| n as usize).map_err(|e| sdq::Error::flag("--sizes", format!("--sizes: {e}"))))
        .collect::<sdq::Result<Vec<_>>>()?;
    for m in &a.modes {
        let mode = match m.as_str() {
            "buffered" => Mode::Buffered,
            "direct" => Mode::Direct,
            "sequential" => Mode::Sequential,
            other => return Err(sdq::Error::flag("--modes", format!("--modes: unknown mode '{other}' (buffered, direct, sequential)"))),
        };
        let depths: &[usize] = if mode == Mode::Sequential { &[1] } else { &a.depths };
        for &size in &sizes {
            for &depth in depths {
                let r = measure(&a.file, mode, size, depth, std::time::Duration::from_secs_f64(a.seconds))?;
                println!("{r}");
            }
        }
    }
    Ok(())
}

#[derive(clap::Args)]
struct LimitArgs {
    /// The limit: 8G, 6144M, bytes.
    #[arg(long)]
    memory: String,
    /// Also cap reads from every disk at this many bytes a second (600M):
    /// a disk of a known rate, for measuring against a bound where the
    /// real rate is not known (a virtual disk the host caches). An error
    /// where the kernel cannot enforce it.
    #[arg(long, conflicts_with = "pid")]
    read_rate: Option<String>,
    /// Write the report as JSON here (default: stderr).
    #[arg(long)]
    report: Option<PathBuf>,
    /// Change the limit of this running process's memory cgroup instead
    /// (e.g. one `sdq limit -- CMD` made): lowering sets the soft limit
    /// first and the hard one once the process has given memory back.
    #[arg(long, conflicts_with = "command")]
    pid: Option<u32>,
    /// With --pid: how long the process has to give memory back.
    #[arg(long, default_value_t = 30.0, requires = "pid")]
    wait: f64,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required_unless_present = "pid")]
    command: Vec<String>,
}

fn limit(a: LimitArgs) -> sdq::Result<ExitCode> {
    let bytes = sdq::units::parse_size(&a.memory).map_err(|e| sdq::Error::flag("--memory", format!("--memory: {e}")))?;
    if let Some(pid) = a.pid {
        if !(0.0..=3600.0).contains(&a.wait) {
            return Err(sdq::Error::flag("--wait", format!("--wait: {} is not 0 to 3600 seconds", a.wait)));
        }
        let r = sdq::commands::limit::change_limit(pid, bytes, std::time::Duration::from_secs_f64(a.wait))?;
        let text = serde_json::to_string_pretty(&r).expect("serialize");
        match &a.report {
            Some(p) => std::fs::write(p, text + "\n").map_err(|e| sdq::Error::io("cannot write", p, e))?,
            None => stderr_line!("{text}"),
        }
        return Ok(ExitCode::SUCCESS);
    }
    let read_rate =
        a.read_rate.as_deref().map(|r| sdq::units::parse_size(r).map_err(|e| sdq::Error::flag("--read-rate", format!("--read-rate: {e}")))).transpose()?;
    let r = sdq::commands::limit::run_limited(bytes, read_rate, &a.command)?;
    let text = serde_json::to_string_pretty(&r).expect("serialize");
    match &a.report {
        Some(p) => std::fs::write(p, text + "\n").map_err(|e| sdq::Error::io("cannot write", p, e))?,
        None => stderr_line!("{text}"),
    }
    let code = r["exit_code"].as_i64().unwrap_or_else(|| 128 + r["signal"].as_i64().unwrap_or(0));
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// The trace: a CSV written by `--sdq-trace FILE`.
    trace: PathBuf,
    /// Arena sizes to replay at: the bytes for expert slots, which a live
    /// run's stats file gives as arena_bytes (K/M/G suffixes).
    #[arg(long = "ram-budget", value_delimiter = ',', required_unless_present = "cycles")]
    ram_budget: Vec<String>,
    /// Arena sizes as multiples of the trace's token cycle (Σ over layers of
    /// top-k × bytes per expert): 0.5,1,2,4.
    #[arg(long, value_delimiter = ',')]
    cycles: Vec<f64>,
    /// Eviction policies to replay: names, or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policy: Vec<String>,
    /// Count only the batches from this step on (the earlier ones are
    /// replayed, so that policies learn from them): to judge a policy on a
    /// part of a trace it was not tuned on.
    #[arg(long, default_value_t = 0)]
    judged_from: u64,
    /// Also replay a reference that is not an online policy: the default
    /// policy told, at each batch, which experts the next this many batches
    /// use (a layer of one step is a batch; a token of every layer is the
    /// layer count). A list replays each.
    #[arg(long, value_delimiter = ',')]
    told_ahead: Vec<u64>,
    /// The share of those uses it is told of (0 to 1).
    #[arg(long, default_value_t = 1.0)]
    told_recall: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn replay(a: ReplayArgs) -> sdq::Result<()> {
    use sdq::engine::pager::PolicyKind;
    let trace = sdq::engine::routing::trace::Trace::open(&a.trace)?;
    let mut policies = Vec::new();
    for p in &a.policy {
        if p.trim().eq_ignore_ascii_case("all") {
            policies.extend(PolicyKind::ALL);
        } else {
            policies.push(PolicyKind::parse(p).map_err(|e| sdq::Error::flag("--policy", format!("--policy: {e}")))?);
        }
    }
    policies.dedup();
    let mut sizes = a
        .ram_budget
        .iter()
        .map(|s| sdq::units::parse_size(s).map_err(|e| sdq::Error::flag("--ram-budget", format!("--ram-budget: {e}"))))
        .collect::<sdq::Result<Vec<u64>>>()?;
    for &c in &a.cycles {
        if !(c.is_finite() && c > 0.0 && c < 1e6) {
            return Err(sdq::Error::flag("--cycles", format!("--cycles: '{c}' is not a positive multiple")));
        }
        sizes.push((c * sdq::commands::replay::token_cycle(&trace) as f64) as u64);
    }
    sizes.sort_unstable();
    sizes.dedup();
    if a.judged_from > 0 && !trace.batches.iter().any(|b| b.step >= a.judged_from) {
        return Err(sdq::Error::flag(
            "--judged-from",
            format!("--judged-from {}: the trace's last step is {}", a.judged_from, trace.batches.last().map_or(0, |b| b.step)),
        ));
    }
    if !(0.0..=1.0).contains(&a.told_recall) {
        return Err(sdq::Error::flag("--told-recall", format!("--told-recall: '{}' is not between 0 and 1", a.told_recall)));
    }
    let told: Vec<sdq::commands::replay::ToldAhead> =
        a.told_ahead.iter().map(|&batches| sdq::commands::replay::ToldAhead { batches, recall: a.told_recall }).collect();
    let report = sdq::commands::replay::Report::new(&a.trace.display().to_string(), &trace, &sizes, &policies, a.judged_from, &told)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json()).expect("serialize"));
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

#[derive(clap::Args)]
struct InspectArgs {
    model: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// The context the tool will run with (its -c); default: the model's own,
    /// as llama.cpp's tools take it. Sizes the KV cache in the budget estimate.
    #[arg(short = 'c', long)]
    ctx_size: Option<u64>,
    /// The projector the tool will load (its --mmproj): its weights and
    /// compute buffers are counted before the arena.
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// The tool's logical batch (its -b; default 2048, the tools').
    #[arg(short = 'b', long = "batch-size")]
    batch_size: Option<u32>,
    /// The tool's physical batch (its -ub; default 512): with -b, sizes the
    /// compute buffers counted before the arena.
    #[arg(long = "ubatch-size", visible_alias = "ub")]
    ubatch_size: Option<u32>,
    /// A routing trace (`--sdq-trace FILE` of an earlier run): with
    /// --ram-budget, predicts the arena's decode held rate (lookups that
    /// need no read) and MiB read per token by replaying it through the
    /// policy (--sdq-policy). A trace of
    /// another geometry is replayed at the same token cycles and scaled: a
    /// projection.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The disk's read rate in MiB/s (`sdq bench-disk`): turns the predicted
    /// MiB per token into the tokens per second reads alone allow.
    #[arg(long, value_name = "MIB_S")]
    read_rate: Option<f64>,
    /// The tool's --spec-type: with `draft-mtp`, the NextN (MTP) block is
    /// loaded, so its experts are paged and its other weights held, and
    /// both are counted.
    #[arg(long, value_name = "TYPES")]
    spec_type: Option<String>,
    /// The tool's draft model (-md): its routed experts are paged beside
    /// the model's, its other weights and its context held, and all counted.
    #[arg(long = "model-draft", value_name = "FILE")]
    model_draft: Option<PathBuf>,
}

fn inspect(a: InspectArgs, opts: &sdq::engine::runtime::options::Options) -> sdq::Result<()> {
    if a.trace.is_some() && opts.budget.is_none() {
        return Err(sdq::Error::flag("--trace", "--trace predicts for an arena: give --ram-budget too"));
    }
    if let Some(r) = a.read_rate.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(sdq::Error::flag("--read-rate", format!("--read-rate: '{r}' is not a positive MiB/s")));
    }
    let plan = sdq::commands::inspect::RunPlan {
        budget: opts.budget,
        reserve: opts.reserve,
        n_ctx: a.ctx_size,
        mmproj: a.mmproj.as_deref(),
        n_batch: a.batch_size,
        n_ubatch: a.ubatch_size,
        trace: a.trace.as_deref(),
        policy: opts.policy,
        read_rate_mib_s: a.read_rate,
        mtp: a.spec_type.as_deref().is_some_and(|t| t.split(',').any(|t| t.trim() == "draft-mtp")),
        draft: a.model_draft.as_deref(),
    };
    let r = sdq::commands::inspect::inspect_run(&a.model, &plan)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r).expect("serialize"));
    } else {
        print!("{}", sdq::commands::inspect::render(&r));
    }
    Ok(())
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Model to run (default: generated once into models/).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// RAM budget for the run (e.g. 1536M, 2G).
    #[arg(long, default_value = "1536M")]
    budget: String,
    #[arg(short, long, default_value_t = 32)]
    n_predict: u32,
    #[arg(short, long)]
    prompt: Option<String>,
}

fn demo(a: DemoArgs) -> sdq::Result<()> {
    let root = std::env::current_dir().map_err(|e| sdq::Error::io("cannot read", std::path::Path::new("."), e))?;
    let mut o = sdq::commands::demo::DemoOptions::with_defaults(&root);
    if let Some(m) = a.model {
        o.model = m;
    }
    o.budget = sdq::units::parse_size(&a.budget).map_err(|e| sdq::Error::flag("--budget", format!("--budget: {e}")))?;
    o.n_predict = a.n_predict;
    if let Some(p) = a.prompt {
        o.prompt = p;
    }
    sdq::commands::demo::run(&o)
}

#[derive(clap::Args)]
struct EvalArgs {
    #[arg(short, long)]
    model: PathBuf,
    #[arg(short, long, default_value = "The quick brown fox")]
    prompt: String,
    /// Read the prompt from a file instead.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    #[arg(short, long, default_value_t = 64)]
    n_predict: usize,
    #[arg(short, long, default_value_t = 2)]
    threads: i32,
    #[arg(short = 'c', long, default_value_t = 1024)]
    ctx_size: u32,
    /// Prompt tokens computed per graph (physical batch, as -ub).
    #[arg(long, default_value_t = 512)]
    ubatch: u32,
    /// Prompt tokens per llama_decode call (logical batch, as -b; default:
    /// the ubatch), which llama.cpp splits into ubatches.
    #[arg(long, default_value_t = 0)]
    batch: u32,
    /// Disable llama.cpp's repacked weight layouts (as --no-repack).
    #[arg(long)]
    no_repack: bool,
    /// Write the final logits here (raw little-endian f32).
    #[arg(long)]
    logits: Option<PathBuf>,
    /// Only load the model and create the context, then exit.
    #[arg(long)]
    load_only: bool,
}

fn eval(a: EvalArgs) -> sdq::Result<()> {
    let prompt = match &a.prompt_file {
        Some(f) => std::fs::read_to_string(f).map_err(|e| sdq::Error::io("cannot read", f, e))?,
        None => a.prompt.clone(),
    };
    let params = sdq::commands::eval::EvalParams {
        prompt,
        n_predict: a.n_predict,
        threads: a.threads,
        n_ctx: a.ctx_size,
        ubatch: a.ubatch,
        batch: a.batch,
        repack: !a.no_repack,
        load_only: a.load_only,
    };
    let r = sdq::commands::eval::run(&a.model, &params)?;
    if let Some(path) = &a.logits {
        let bytes: Vec<u8> = r.logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(path, bytes).map_err(|e| sdq::Error::io("cannot write", path, e))?;
    }
    let out = serde_json::json!({ "prompt_tokens": r.prompt_tokens.len(), "tokens": r.tokens, "text": r.text });
    println!("{out}");
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    // sdq's budget options work for `sdq eval` as on every tool, and tell
    // `sdq inspect` what to assume; other commands leave them to the
    // commands they run (`sdq limit -- llama-cli --ram-budget auto`).
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let takes_options = matches!(args.get(1).and_then(|a| a.to_str()), Some("eval" | "inspect"));
    let opts = if takes_options {
        let is_eval = args.get(1).is_some_and(|a| a == "eval");
        match sdq::engine::runtime::options::Options::from_args_and_env(&mut args, |k| std::env::var(k).ok()).and_then(|o| {
            // inspect may plan for any budget; a run must be able to honour it
            match o.budget {
                Some(b) if is_eval => sdq::engine::memory::budget::check_against_ram(b).map(|()| o),
                None if is_eval => o.check_needs_budget().map(|()| o),
                _ => Ok(o),
            }
        }) {
            Ok(o) => o,
            Err(e) => {
                stderr_line!("sdq: error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        sdq::engine::runtime::options::Options::default()
    };
    let cli = Cli::parse_from(args);
    // Only `sdq eval` runs a model in this process; `inspect` just reads the budget.
    if opts.budget.is_some() && matches!(cli.command, Command::Eval(_)) {
        if let Err(e) = sdq::engine::runtime::install(opts.clone()) {
            stderr_line!("sdq: error: {e}");
            return ExitCode::FAILURE;
        }
        sdq::engine::hooks::install();
    }
    let result = match cli.command {
        Command::GenModel(a) => genmodel::run(*a),
        Command::Eval(a) => eval(a),
        Command::Demo(a) => demo(a),
        Command::Inspect(a) => inspect(a, &opts),
        Command::BenchDisk(a) => bench_disk(a),
        Command::Replay(a) => replay(a),
        Command::Limit(a) => match limit(a) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
    };
    let honoured = sdq::engine::runtime::get().map_or(true, |rt| rt.finish(true));
    match result {
        Ok(()) if !honoured => ExitCode::FAILURE,
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            stderr_line!("sdq: error: {e}");
            ExitCode::FAILURE
        }
    }
}
