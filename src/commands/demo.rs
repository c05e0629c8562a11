//! `sdq demo`: the whole idea in one command. Generates (once) a MoE model
//! several times larger than a RAM budget, runs a greedy completion in that
//! budget with the drop-in `llama-completion`, runs it again without a budget,
//! and shows that the text is the same and what the pager did.

use crate::commands::genmodel::{self, GenOptions, ModelSpec};
use crate::error::{Error, Result};
use crate::units::{human, parse_size};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Demo settings.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub model: PathBuf,
    pub budget: u64,
    pub n_predict: u32,
    pub prompt: String,
    pub threads: usize,
}

impl DemoOptions {
    pub fn with_defaults(root: &Path) -> DemoOptions {
        DemoOptions {
            model: root.join("models/demo-35b-a3b-8layers.gguf"),
            budget: parse_size("1536M").expect("constant"),
            n_predict: 32,
            prompt: "Once upon a time, in a town by the sea,".into(),
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// The demo model: the 35B-A3B geometry (256 experts top-8, expert FFN 512,
/// n_embd 2048, hybrid attention) cut to 8 layers, about 4.8 GB (4.47 GiB).
pub fn demo_spec() -> ModelSpec {
    let mut spec = ModelSpec::preset("35b-a3b").expect("preset");
    spec.n_layer = 8;
    spec.context_length = 4096;
    spec
}

struct Run {
    text: String,
    tokens_per_second: Option<f64>,
    stats: Option<serde_json::Value>,
}

/// The drop-in tool `name` next to this executable. Under `cargo run`
/// (the README's first command builds only `sdq`), the tools are built
/// first, with the same profile, by the cargo that started us.
fn tool(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| Error::io("cannot locate", Path::new("sdq"), e))?;
    let p = exe.with_file_name(name);
    if !p.is_file() {
        if let (Some(cargo), Some(manifest)) = (std::env::var_os("CARGO"), std::env::var_os("CARGO_MANIFEST_DIR")) {
            let release = exe.parent().and_then(|d| d.file_name()).is_some_and(|n| n == "release");
            println!("building the drop-in llama.cpp tools (once)...");
            let mut build = Command::new(cargo);
            build.args(["build", "--bins", "--manifest-path"]).arg(Path::new(&manifest).join("Cargo.toml"));
            if release {
                build.arg("--release");
            }
            let ok = build.status().is_ok_and(|s| s.success());
            if !ok {
                return Err(Error::invalid("building the drop-in tools failed; run `cargo build --release` and try again".to_string()));
            }
        }
    }
    if !p.is_file() {
        return Err(Error::invalid(format!("{} not found next to sdq (run `cargo build --release` first)", p.display())));
    }
    Ok(p)
}

/// Runs llama-completion greedily (`--top-k 1`) with stock's defaults: the
/// pager reproduces them bit for bit, repacked kernels included.
fn complete(o: &DemoOptions, budget: Option<u64>, stats: &Path) -> Result<Run> {
    let mut cmd = Command::new(tool("llama-completion")?);
    cmd.args(["-m", &o.model.to_string_lossy(), "-p", &o.prompt, "-n", &o.n_predict.to_string()])
        .args(["--top-k", "1", "-no-cnv", "-c", "1024", "--seed", "1"])
        .args(["-t", &o.threads.to_string()])
        .env_remove("SDQ_RAM_BUDGET")
        .stdin(std::process::Stdio::null());
    if let Some(b) = budget {
        cmd.args(["--ram-budget", &b.to_string(), "--sdq-stats", &stats.to_string_lossy()]);
    }
    let out = cmd.output().map_err(|e| Error::io("cannot run", Path::new("llama-completion"), e))?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        return Err(Error::invalid(format!("llama-completion failed ({}): {last}", out.status)));
    }
    let tokens_per_second = err
        .lines()
        .find(|l| l.contains(" eval time") && !l.contains("prompt"))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok());
    let stats = budget.and_then(|_| std::fs::read_to_string(stats).ok()).and_then(|s| serde_json::from_str(&s).ok());
    Ok(Run { text: String::from_utf8_lossy(&out.stdout).into_owned(), tokens_per_second, stats })
}

/// Runs the demo, printing as it goes. Errs if the budgeted text differs.
pub fn run(o: &DemoOptions) -> Result<()> {
    let spec = demo_spec();
    if !o.model.is_file() {
        println!("generating the demo model {} (once; about 4.8 GB, a minute)...", o.model.display());
        if let Some(dir) = o.model.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
        }
        let gen = GenOptions {
            out: o.model.clone(),
            vocab_file: genmodel::default_vocab_file(),
            threads: o.threads,
            progress: true,
            preset: "demo (35b-a3b, 8 layers)".into(),
            image_tokens: false,
            split_max_bytes: None,
        };
        genmodel::generate(&spec, &gen)?;
    }
    let size = std::fs::metadata(&o.model).map_err(|e| Error::io("cannot stat", &o.model, e))?.len();
    let expert_bytes: u64 = spec.plan().iter().filter(|t| t.name.ends_with("_exps.weight")).map(|t| t.nbytes()).sum();
    println!(
        "model: {} ({}, of which {} routed experts: {} layers x {} experts, top-{})",
        o.model.display(),
        human(size),
        human(expert_bytes),
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used
    );
    println!("RAM budget: {} ({:.1}x smaller than the model)\nprompt: {:?}\n", human(o.budget), size as f64 / o.budget as f64, o.prompt);

    let stats_path = std::env::temp_dir().join(format!("sdq-demo-{}.json", std::process::id()));
    let paged = complete(o, Some(o.budget), &stats_path)?;
    let _ = std::fs::remove_file(&stats_path);
    println!("--- llama-completion --ram-budget {} ---\n{}\n", human(o.budget), paged.text.trim_end());
    let stock = complete(o, None, &stats_path)?;
    let same = paged.text == stock.text;
    println!("--- the same without a budget (stock llama.cpp, model mmapped) ---\nidentical text: {}\n", if same { "yes" } else { "NO" });

    if let Some(s) = &paged.stats {
        let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
        println!(
            "pager: hit {:.1} % | {:.1} MiB read per token | arena {} | peak anonymous RSS {} of {} budget | swap {}",
            100.0 * f("hit_rate"),
            f("mib_read_per_token"),
            human(f("arena_bytes") as u64),
            human(f("peak_rss_anon_bytes") as u64),
            human(o.budget),
            human(f("vm_swap_bytes") as u64)
        );
    }
    let tps = |r: &Run| r.tokens_per_second.map_or("?".to_string(), |t| format!("{t:.1}"));
    println!("decode: {} tok/s in the budget, {} tok/s stock (whole model in RAM/page cache)", tps(&paged), tps(&stock));
    if !same {
        return Err(Error::invalid(format!("the budgeted text differs from stock's:\n{}\nvs\n{}", paged.text, stock.text)));
    }
    Ok(())
}
