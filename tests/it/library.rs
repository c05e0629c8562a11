//! sdq inside programs that link llama.cpp (issue 30): the build's
//! target/release/lib/libllama.so (with the pager) and libmtmd.so, used from
//! a C program linked with `-lllama` and from llama-cpp-python, with the
//! budget from the environment.

use crate::util::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// target/release/lib.
pub(crate) fn lib_dir() -> PathBuf {
    bin("sdq").with_file_name("lib")
}

const PROMPT: &str = "The rivers and the mountains";

/// llama-completion's greedy text for `PROMPT` (its own flags plus `extra`),
/// without the prompt: what a program that links libllama must reproduce.
fn completion_text(model: &Path, n: u32, extra: &[&str]) -> String {
    let o = run(
        Command::new(bin("llama-completion"))
            .args(["-m", model.to_str().unwrap(), "-p", PROMPT, "-n", &n.to_string(), "--top-k", "1", "-no-cnv", "--no-display-prompt"])
            .args(extra),
        300,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o).trim_end().to_string()
}

/// llama-completion's flags for the settings the Python scripts give
/// `Llama(...)` (n_ctx 256, n_batch and n_ubatch 512, 2 threads, no flash
/// attention) and its completions (repeat_penalty 1).
const PYTHON_SETTINGS: [&str; 12] = ["-c", "256", "-b", "512", "-ub", "512", "-t", "2", "-fa", "off", "--repeat-penalty", "1"];

/// The text a script wrote as `LABEL: TEXT\n@@\n` into `out`, trimmed at
/// the end.
fn labelled(out: &str, label: &str) -> Option<String> {
    out.split(&format!("{label}: ")).nth(1).and_then(|t| t.split("\n@@\n").next()).map(|t| t.trim_end().to_string())
}

/// The sonames and versions are upstream's (llama.cpp's 0.5.0, ggml's
/// 0.25.3), and libmtmd.so and ggml's names need only libllama.so.0 of
/// these libraries (so every call reaches the one copy, with the pager),
/// found beside them.
#[test]
fn the_libraries_carry_upstreams_names() {
    let lib = lib_dir();
    for (name, real) in [
        ("libllama.so", "libllama.so.0.5.0"),
        ("libmtmd.so", "libmtmd.so.0.5.0"),
        ("libggml.so", "libggml.so.0.25.3"),
        ("libggml-base.so", "libggml-base.so.0.25.3"),
        ("libggml-cpu.so", "libggml-cpu.so.0.25.3"),
    ] {
        let resolved = std::fs::canonicalize(lib.join(name)).unwrap();
        assert!(
            lib.join(real).exists() && std::fs::read_link(lib.join(name)).unwrap() == Path::new(&name.replace(".so", ".so.0")),
            "{name} -> {}",
            resolved.display()
        );
        let o = run(Command::new("readelf").args(["-d"]).arg(lib.join(name)), 30);
        let text = stdout(&o);
        let soname = name.replace(".so", ".so.0");
        assert!(text.contains(&format!("Library soname: [{soname}]")), "{name}: {text}");
        if name != "libllama.so" {
            let needed: Vec<&str> = text.lines().filter(|l| l.contains("(NEEDED)")).collect();
            assert!(
                needed.iter().any(|l| l.contains("[libllama.so.0]")) && !needed.iter().any(|l| l.contains("libggml")) && text.contains("$ORIGIN"),
                "{text}"
            );
        }
    }
    // The C API of llama.h is exported; sdq's own symbols are not.
    let o = run(Command::new("nm").args(["-D", "--defined-only"]).arg(lib.join("libllama.so")), 60);
    let syms = stdout(&o);
    for f in ["llama_model_load_from_file", "llama_decode", "ggml_backend_load_all", "gguf_init_from_file", "llama_model_get_tok_embd"] {
        assert!(syms.lines().any(|l| l.contains(f)), "libllama.so does not export {f}");
    }
    assert!(!syms.lines().any(|l| l.ends_with(" sdq_set_hooks") || l.contains("runtime7install")), "sdq's internals are exported");
}

/// What target/release/lib/pkgconfig/llama.pc gives a build (its `Cflags`
/// and `Libs`, variables expanded), as `pkg-config --cflags --libs llama`
/// would.
fn pkg_config_flags() -> Vec<String> {
    let text = std::fs::read_to_string(lib_dir().join("pkgconfig/llama.pc")).unwrap();
    let mut vars: Vec<(String, String)> = Vec::new();
    let expand = |v: &str, vars: &[(String, String)]| vars.iter().fold(v.to_string(), |acc, (k, val)| acc.replace(&format!("${{{k}}}"), val));
    let mut flags = Vec::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once('=').filter(|(k, _)| !k.contains(':') && !k.contains(' ')) {
            let v = expand(v, &vars);
            vars.push((k.to_string(), v));
        } else if let Some(v) = line.strip_prefix("Cflags:").or_else(|| line.strip_prefix("Libs:")) {
            flags.extend(expand(v, &vars).split_whitespace().map(str::to_string));
        }
    }
    flags
}

/// tests/c/greedy.c, built as llama.pc says (the shipped headers,
/// `-lggml -lggml-base -lllama` from target/release/lib), once per run.
pub(crate) fn c_program() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let exe = scratch().join("greedy-c");
        let flags = pkg_config_flags();
        assert!(flags.contains(&"-lllama".to_string()) && flags.contains(&"-lggml".to_string()), "llama.pc: {flags:?}");
        let o = run(
            Command::new("cc")
                .arg("-O1")
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/greedy.c"))
                .args(&flags)
                .arg(format!("-Wl,-rpath,{}", lib_dir().display()))
                .arg("-o")
                .arg(&exe),
            120,
        );
        assert!(o.status.success(), "cc: {}", stderr(&o));
        exe
    })
    .clone()
}

/// A C program in the style of upstream's examples/simple, built as
/// llama.pc says (the shipped headers, `-lggml -lggml-base -lllama`),
/// with its own log callback: without a budget it gives
/// llama-completion's greedy text; with `SDQ_RAM_BUDGET` (an arena of about
/// one and a half token cycles) the same text, with experts paged, the stats
/// file written and the budget held.
#[test]
fn a_c_program_linked_with_libllama_pages_under_a_budget() {
    let exe = c_program();
    let model = tiny_preset();
    let greedy = |env: &[(&str, &str)]| {
        let o = run(Command::new(&exe).args([model.to_str().unwrap(), "24", PROMPT]).env_remove("SDQ_RAM_BUDGET").envs(env.iter().copied()), 300);
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o).trim_end().to_string(), stderr(&o))
    };
    let (stock, _) = greedy(&[]);
    assert_eq!(stock, completion_text(model, 24, &[]), "the C program without a budget differs from llama-completion");

    let probe_stats = scratch().join("library-c-probe.json");
    greedy(&[("SDQ_RAM_BUDGET", "2G"), ("SDQ_RESERVE_MB", "16"), ("SDQ_STATS_FILE", probe_stats.to_str().unwrap())]);
    let probe: Value = read_json(&probe_stats);
    let cycle: u64 = probe["layers"].as_array().unwrap().iter().map(|l| u(l, "expert_bytes") * u(&probe, "top_k")).sum();
    let budget = crate::pager::budget_for(&probe, 16 << 20, cycle * 3 / 2);
    let stats = scratch().join("library-c-stats.json");
    let (paged, err) = greedy(&[("SDQ_RAM_BUDGET", &budget), ("SDQ_RESERVE_MB", "16"), ("SDQ_STATS_FILE", stats.to_str().unwrap()), ("SDQ_PRELOAD", "0")]);
    assert_eq!(paged, stock, "under SDQ_RAM_BUDGET the C program answered unlike stock");
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0 && u(&s, "arena_bytes") < u(&s, "expert_bytes_total"), "{s}");
    assert!(u(&s, "peak_rss_anon_bytes") <= budget.parse::<u64>().unwrap() && u(&s, "vm_swap_bytes") == 0, "{s}");
    assert!(err.contains("sdq: hit"), "no summary line: {err}");
}

/// A virtual environment with llama-cpp-python 0.3.36 (the pinned sdist, the
/// very tree sdq builds) installed as pure Python (`CMAKE_ARGS=-DLLAMA_BUILD=OFF`),
/// its dependencies pinned (tests/python/requirements.txt); made once per
/// target directory. Returns its python.
fn venv() -> PathBuf {
    static VENV: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    VENV.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama-cpp-python");
        let python = dir.join("bin/python");
        let requirements = root.join("tests/python/requirements.txt");
        let stamp = dir.join(".sdq-installed");
        let want = std::fs::read_to_string(&requirements).unwrap();
        if std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
            return python;
        }
        let _ = std::fs::remove_dir_all(&dir);
        let o = run(Command::new("python3").args(["-m", "venv"]).arg(&dir), 300);
        assert!(o.status.success(), "python3 -m venv: {}", stderr(&o));
        let pip = |args: &[&str], env: &[(&str, &str)]| {
            let o = run(Command::new(&python).args(["-m", "pip", "install", "--disable-pip-version-check", "-q"]).args(args).envs(env.iter().copied()), 1200);
            assert!(o.status.success(), "pip install {args:?}: {}{}", stdout(&o), stderr(&o));
        };
        pip(&["-r", requirements.to_str().unwrap()], &[]);
        let sdist = root.join("vendor/.cache/llama_cpp_python-0.3.36.tar.gz");
        pip(&["--no-deps", "--no-build-isolation", sdist.to_str().unwrap()], &[("CMAKE_ARGS", "-DLLAMA_BUILD=OFF")]);
        std::fs::write(&stamp, want).unwrap();
        python
    })
    .clone()
}

/// `Llama(model_path=...)` under `SDQ_RAM_BUDGET` gives llama-completion's
/// greedy tokens with the same settings, pages experts, writes the stats
/// file and holds the budget; without the variable it is stock.
#[test]
fn llama_cpp_python_pages_under_a_budget() {
    let python = venv();
    let model = tiny_preset();
    let script = r#"
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=False, verbose=False, seed=1)
out = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), top_k=1, temperature=0.0, repeat_penalty=1.0)
sys.stdout.write(out["choices"][0]["text"])
"#;
    let expected = completion_text(model, 24, &PYTHON_SETTINGS);
    let complete = |env: &[(&str, &str)]| {
        let o = run(
            Command::new(&python)
                .args(["-c", script, model.to_str().unwrap(), PROMPT, "24"])
                .env("LLAMA_CPP_LIB_PATH", lib_dir())
                .env_remove("SDQ_RAM_BUDGET")
                .envs(env.iter().copied()),
            300,
        );
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o).trim_end().to_string(), stderr(&o))
    };
    let (stock, _) = complete(&[]);
    assert_eq!(stock, expected, "llama-cpp-python on sdq's libllama without a budget differs from llama-completion");
    let stats = scratch().join("library-python-stats.json");
    let budget = "400M";
    let (paged, err) = complete(&[("SDQ_RAM_BUDGET", budget), ("SDQ_STATS_FILE", stats.to_str().unwrap()), ("SDQ_PRELOAD", "0")]);
    assert_eq!(paged, expected, "llama-cpp-python under SDQ_RAM_BUDGET answered unlike llama-completion");
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0 && u(&s, "peak_rss_anon_bytes") <= 400 << 20 && u(&s, "vm_swap_bytes") == 0, "{s}");
    assert!(err.contains("sdq: hit"), "{err}");
}

/// `python -m llama_cpp.server` on sdq's libllama answers an OpenAI chat
/// request under the budget, as it does without one.
#[test]
fn llama_cpp_python_server_answers_under_a_budget() {
    let python = venv();
    let model = tiny_preset();
    let body = r#"{"messages":[{"role":"user","content":"Hello there"}],"max_tokens":12,"top_k":1,"temperature":0,"repeat_penalty":1.0}"#;
    let answer = |env: &[(&str, &str)]| -> String {
        let port = free_port();
        let child = Command::new(&python)
            .args(["-m", "llama_cpp.server", "--model", model.to_str().unwrap(), "--port", &port.to_string(), "--n_ctx", "512", "--n_threads", "2"])
            .env("LLAMA_CPP_LIB_PATH", lib_dir())
            .env_remove("SDQ_RAM_BUDGET")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(scratch().join("library-python-server.log")).unwrap())
            .spawn()
            .unwrap();
        let mut server = KillOnDrop(child);
        let reply = wait_until("llama_cpp.server answering", 120, || match http(port, "POST", "/v1/chat/completions", Some(body)) {
            Ok((200, text)) => Some(text),
            Ok((code, text)) => panic!("HTTP {code}: {text}"),
            Err(_) => None,
        });
        // SIGINT: uvicorn shuts down and Python exits normally, so the stats are written.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(server.0.id() as i32, libc::SIGINT) };
        let _ = poll_until(60, || server.0.try_wait().unwrap());
        let v: Value = serde_json::from_str(&reply).unwrap();
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let stock = answer(&[]);
    let stats = scratch().join("library-python-server-stats.json");
    let paged = answer(&[("SDQ_RAM_BUDGET", "500M"), ("SDQ_STATS_FILE", stats.to_str().unwrap()), ("SDQ_PRELOAD", "0")]);
    assert!(!stock.is_empty() && paged == stock, "chat under the budget: {paged:?}, without: {stock:?}");
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0 && u(&s, "peak_rss_anon_bytes") <= 500 << 20, "{s}");
}

/// What ends a tool fails the call inside a host program, which goes on:
/// a budget too small for the arena and an expert read that fails past its
/// retries make `llama_decode` return non-zero, and a bad file makes
/// `llama_model_load_from_file` return NULL; sdq's line (or llama.cpp's) is
/// on stderr and in the program's log callback. The C program reports each
/// failure itself ("error: ..."), so the process was not ended from inside
/// the library.
#[test]
fn errors_inside_a_c_program_are_the_programs() {
    let exe = c_program();
    let model = tiny_preset();
    let greedy = |model: &Path, env: &[(&str, &str)]| {
        let o = run(Command::new(&exe).args([model.to_str().unwrap(), "8", PROMPT]).env_remove("SDQ_RAM_BUDGET").envs(env.iter().copied()), 300);
        (o.status.code(), stderr(&o))
    };
    let probe_stats = scratch().join("library-errors-probe.json");
    greedy(model, &[("SDQ_RAM_BUDGET", "2G"), ("SDQ_RESERVE_MB", "16"), ("SDQ_STATS_FILE", probe_stats.to_str().unwrap())]);
    let probe: Value = read_json(&probe_stats);
    // Room for the reserve and not one layer's experts.
    let small = (held_after_load(&probe) + (16 << 20)).to_string();
    // The context is refused where the program can act on it (issue 49),
    // with sdq's line in its log callback, and the exit line says so.
    let (code, err) = greedy(model, &[("SDQ_RAM_BUDGET", &small), ("SDQ_RESERVE_MB", "16")]);
    assert!(code == Some(1) && err.contains("error: cannot create a context") && !err.contains("llama_decode"), "{code:?}: {err}");
    assert!(err.lines().any(|l| l.starts_with("log(4): sdq: error: RAM budget") && l.contains("is too small") && l.contains("the minimum budget is")), "{err}");
    let exit = err.lines().find(|l| l.starts_with("sdq: no routed experts were paged")).unwrap_or_default();
    assert!(exit.contains("(1 model load or context failed: RAM budget") && !exit.contains("none were used"), "{err}");

    let fault = scratch().join("library-errors-fault");
    std::fs::write(&fault, "").unwrap();
    let spec = format!("eio-while={}", fault.display());
    let (code, err) = greedy(model, &[("SDQ_RAM_BUDGET", "1G"), ("SDQ_FAULT_READ", &spec), ("SDQ_PRELOAD", "0"), ("SDQ_READ_BACKOFF_MS", "1")]);
    std::fs::remove_file(&fault).unwrap();
    assert!(
        code == Some(1) && err.contains("the batch is abandoned") && err.contains(model.to_str().unwrap()) && err.contains("error: llama_decode returned 2"),
        "{code:?}: {err}"
    );
    // The program's log callback gets sdq's line at error level too; the
    // exit line counts the failed batch.
    assert!(err.lines().any(|l| l.starts_with("log(4): sdq: error: ") && l.ends_with("the batch is abandoned")), "{err}");
    assert!(err.lines().any(|l| l.starts_with("sdq: hit") && l.ends_with("| 1 batch failed")), "{err}");

    let bad = scratch().join("library-errors-truncated.gguf");
    let bytes = std::fs::read(model).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let (code, err) = greedy(&bad, &[("SDQ_RAM_BUDGET", "1G")]);
    assert!(code == Some(1) && err.contains("error: cannot load") && !err.contains("panicked"), "{code:?}: {err}");
    let exit = err.lines().find(|l| l.starts_with("sdq: no routed experts were paged")).unwrap_or_default();
    assert!(exit.contains("(1 model load or context failed: ") && exit.contains("library-errors-truncated.gguf"), "{err}");
}

/// The same failures from Python: llama-cpp-python raises its own exception
/// (ValueError for a model that does not load, RuntimeError for a failed
/// decode), sdq's line is on stderr, and the interpreter goes on: after the
/// failing reads stop, the same `Llama` answers as llama-completion does.
#[test]
fn errors_inside_llama_cpp_python_are_exceptions() {
    let python = venv();
    let model = tiny_preset();
    let bad = scratch().join("library-python-truncated.gguf");
    let bytes = std::fs::read(model).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let fault = scratch().join("library-python-fault");
    std::fs::write(&fault, "").unwrap();
    let script = r#"
import os, sys
from llama_cpp import Llama
model, bad, fault, prompt, other = sys.argv[1:6]
try:
    Llama(model_path=bad, verbose=False)
    print("bad file: loaded")
except ValueError as e:
    print("bad file: ValueError")
llm = Llama(model_path=model, n_ctx=256, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=False, verbose=False, seed=1)
def complete():
    return llm.create_completion(prompt, max_tokens=24, top_k=1, temperature=0.0, repeat_penalty=1.0)["choices"][0]["text"]
try:
    complete()
    print("failing reads: answered")
except RuntimeError as e:
    print("failing reads: RuntimeError " + str(e))
os.remove(fault)
llm.reset()
sys.stdout.write("after: " + complete() + "\n@@\n")
try:
    # verbose: llama-cpp-python hides stderr while a model loads unless asked.
    Llama(model_path=other, verbose=True)
    print("another model: loaded")
except ValueError as e:
    print("another model: ValueError")
llm.reset()
sys.stdout.write("still: " + complete() + "\n@@\n")
"#;
    // Another model with routed experts, loaded after the first was used:
    // the arena was planned for the first.
    let other = TempModel::generate("library-other.gguf", &["--preset", "tiny", "--seed", "2"]);
    let spec = format!("eio-while={}", fault.display());
    let o = run(
        Command::new(&python)
            .args(["-c", script, model.to_str().unwrap(), bad.to_str().unwrap(), fault.to_str().unwrap(), PROMPT, other.to_str().unwrap()])
            .env("LLAMA_CPP_LIB_PATH", lib_dir())
            .envs([("SDQ_RAM_BUDGET", "1G"), ("SDQ_FAULT_READ", spec.as_str()), ("SDQ_PRELOAD", "0"), ("SDQ_READ_BACKOFF_MS", "1")]),
        300,
    );
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}{err}");
    let expected = completion_text(model, 24, &PYTHON_SETTINGS);
    assert!(out.contains("bad file: ValueError") && out.contains("failing reads: RuntimeError llama_decode returned 2"), "{out}{err}");
    assert!(err.contains("the batch is abandoned") && err.contains(model.to_str().unwrap()), "{err}");
    assert_eq!(labelled(&out, "after").as_deref(), Some(expected.as_str()), "{out}");
    assert!(out.contains("another model: ValueError") && err.contains("a model with routed experts loaded after the first batch ran"), "{out}{err}");
    assert_eq!(labelled(&out, "still").as_deref(), Some(expected.as_str()), "the first model after the second failed to load: {out}");

    // A budget too small for the arena: `Llama(...)` raises (its context is
    // refused, with sdq's line naming the minimum), the interpreter goes on
    // and ends normally, and the exit line says what happened. A model
    // loaded and never used says that too.
    let script = r#"
import sys
from llama_cpp import Llama
try:
    llm = Llama(model_path=sys.argv[1], verbose=False)
    print("made")
except ValueError as e:
    print("ValueError " + str(e))
print("goes on")
"#;
    let o = run(
        Command::new(&python)
            .args(["-c", script, model.to_str().unwrap()])
            .env("LLAMA_CPP_LIB_PATH", lib_dir())
            .envs([("SDQ_RAM_BUDGET", "64M"), ("SDQ_RESERVE_MB", "16")]),
        300,
    );
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success() && out.contains("ValueError Failed to create llama_context") && out.contains("goes on"), "{out}{err}");
    assert!(err.contains("is too small") && err.contains("the minimum budget is"), "{err}");
    assert!(err.contains("sdq: no routed experts were paged (1 model load or context failed: RAM budget 64.0 MiB is too small"), "{err}");

    let script = "import sys\nfrom llama_cpp import Llama\nLlama(model_path=sys.argv[1], verbose=False)\nprint('made')\n";
    let o = run(Command::new(&python).args(["-c", script, model.to_str().unwrap()]).env("LLAMA_CPP_LIB_PATH", lib_dir()).env("SDQ_RAM_BUDGET", "1G"), 300);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success() && out.contains("made") && err.contains("sdq: no routed experts were paged (nothing was decoded)"), "{out}{err}");
}

/// A panic in sdq's code is the error of the call it happened in, never
/// the end of the host (issue 49): `SDQ_FAULT_READ=panic@1` makes the
/// pager's first read panic. The C program's `llama_decode` returns an
/// error, which the program reports itself; llama-cpp-python raises
/// RuntimeError, and the same `Llama` then answers as llama-completion does
/// (a read that panicked is not tried again within its batch, and the next
/// batch reads the expert anew). No panic message or backtrace reaches the
/// host's stderr; sdq's line names the read and the panic.
#[test]
fn a_panic_inside_sdq_fails_the_call_not_the_host() {
    let model = tiny_preset();
    let env = [("SDQ_RAM_BUDGET", "1G"), ("SDQ_FAULT_READ", "panic@1"), ("SDQ_PRELOAD", "0")];
    let o = run(Command::new(c_program()).args([model.to_str().unwrap(), "8", PROMPT]).envs(env), 300);
    let err = stderr(&o);
    assert!(o.status.code() == Some(1) && err.contains("error: llama_decode returned 2"), "{:?}: {err}", o.status.code());
    assert!(err.contains("injected panic on read 1 (SDQ_FAULT_READ)") && err.contains("of expert") && err.contains("internal error"), "{err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{err}");

    let script = r#"
import sys
from llama_cpp import Llama
model, prompt = sys.argv[1:3]
llm = Llama(model_path=model, n_ctx=256, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=False, verbose=False, seed=1)
def complete():
    return llm.create_completion(prompt, max_tokens=24, top_k=1, temperature=0.0, repeat_penalty=1.0)["choices"][0]["text"]
try:
    complete()
    print("panicking read: answered")
except RuntimeError as e:
    print("panicking read: RuntimeError " + str(e))
llm.reset()
sys.stdout.write("after: " + complete() + "\n@@\n")
"#;
    let o = run(Command::new(venv()).args(["-c", script, model.to_str().unwrap(), PROMPT]).env("LLAMA_CPP_LIB_PATH", lib_dir()).envs(env), 300);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("panicking read: RuntimeError llama_decode returned 2"), "{out}{err}");
    assert!(err.contains("injected panic on read 1") && !err.contains("panicked"), "{err}");
    let expected = completion_text(model, 24, &PYTHON_SETTINGS);
    let after = labelled(&out, "after");
    assert_eq!(after.as_deref(), Some(expected.as_str()), "{out}");
}

/// Two models in one process under one `SDQ_RAM_BUDGET` (issue 49): a
/// program loads model A twice (the same file) and another model B, then
/// uses them in turn; each answers as llama-completion does without a
/// budget, and the process stays within the budget, an arena of one and a
/// half token cycles of all three (the first run finds what the models
/// hold). Freeing every model gives the arena's memory back (its resident
/// bytes, from /proc/self/smaps in the stats file, drop to nothing); B
/// loaded again gets
/// an arena of its own and answers the same. A model loaded after another has computed, while that
/// one is still alive, is refused at its load, naming both.
#[test]
fn two_models_in_one_process_share_one_budget() {
    let python = venv();
    let (a, b) = (tiny_preset(), TempModel::generate("library-two-b.gguf", &["--preset", "tiny", "--seed", "3"]));
    let (want_a, want_b) = (completion_text(a, 24, &PYTHON_SETTINGS), completion_text(&b, 24, &PYTHON_SETTINGS));
    assert_ne!(want_a, want_b, "the two models answer alike: the test could not tell them apart");
    let script = r#"
import json, sys, time
from llama_cpp import Llama
a_path, b_path, prompt, stats = sys.argv[1:5]
kw = dict(n_ctx=256, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=False, verbose=False, seed=1)
def snapshot(until):
    # The stats file's snapshots (about every second) until one meets
    # `until` (within 20 s); arena_resident_bytes come from the arena's
    # mappings in /proc/self/smaps.
    deadline = time.time() + 20
    while True:
        time.sleep(0.5)
        try:
            s = json.load(open(stats))
        except (OSError, ValueError):
            continue
        if until(s) or time.time() > deadline:
            return s
def complete(llm):
    llm.reset()
    return llm.create_completion(prompt, max_tokens=24, top_k=1, temperature=0.0, repeat_penalty=1.0)["choices"][0]["text"]
def say(label, text):
    sys.stdout.write(label + ": " + text + "\n@@\n")
a, a2, b = Llama(model_path=a_path, **kw), Llama(model_path=a_path, **kw), Llama(model_path=b_path, **kw)
say("b", complete(b)); say("a", complete(a)); say("a2", complete(a2)); say("b again", complete(b))
first = snapshot(lambda s: s.get("arena_resident_bytes", 0) > 0)
print("three models: " + json.dumps(first))
a.close(); a2.close(); b.close()
print("arena held %d then %d" % (first["arena_resident_bytes"], snapshot(lambda s: s.get("arena_resident_bytes") == 0)["arena_resident_bytes"]))
c = Llama(model_path=b_path, **kw)
say("b reloaded", complete(c))
try:
    # verbose: llama-cpp-python hides stderr while a model loads unless asked.
    Llama(model_path=a_path, **dict(kw, verbose=True))
    print("late load: loaded")
except ValueError:
    print("late load: ValueError")
"#;
    let run_with = |budget: &str, stats: &Path| {
        let _ = std::fs::remove_file(stats);
        let o = run(
            Command::new(&python)
                .args(["-c", script, a.to_str().unwrap(), b.to_str().unwrap(), PROMPT, stats.to_str().unwrap()])
                .env("LLAMA_CPP_LIB_PATH", lib_dir())
                .envs([("SDQ_RAM_BUDGET", budget), ("SDQ_RESERVE_MB", "16"), ("SDQ_STATS_FILE", stats.to_str().unwrap()), ("SDQ_PRELOAD", "0")]),
            300,
        );
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{out}{err}");
        (out, err)
    };
    // What the three models hold while all are loaded (the arena planned
    // for them, before any is freed).
    let (out, _) = run_with("1G", &scratch().join("library-two-probe.json"));
    let probe: Value = serde_json::from_str(out.lines().find_map(|l| l.strip_prefix("three models: ")).unwrap()).unwrap();
    let cycle: u64 = probe["layers"].as_array().unwrap().iter().map(|l| u(l, "expert_bytes") * u(&probe, "top_k")).sum();
    // Weights left in the file mapping count against the budget too.
    let budget = crate::pager::budget_for(&probe, 16 << 20, cycle * 3 / 2 + u(&probe, "mapped_weight_bytes"));
    let stats = scratch().join("library-two-stats.json");
    let (out, err) = run_with(&budget, &stats);
    for (label, want) in [("b", &want_b), ("a", &want_a), ("a2", &want_a), ("b again", &want_b), ("b reloaded", &want_b)] {
        assert_eq!(labelled(&out, label).as_ref(), Some(want), "{label}: {out}");
    }
    let held: Vec<u64> = out.lines().find_map(|l| l.strip_prefix("arena held ")).unwrap().split(" then ").map(|n| n.parse().unwrap()).collect();
    assert!(held[0] >= 4 << 20 && held[1] <= 256 << 10, "the arena's mapping held {} bytes, and {} after every model was freed: {out}", held[0], held[1]);
    assert!(out.contains("late load: ValueError") && err.contains("a model with routed experts loaded after the first batch ran"), "{out}{err}");
    let s: Value = read_json(&stats);
    let budget: u64 = budget.parse().unwrap();
    assert!(u(&s, "peak_rss_anon_bytes") <= budget && u(&s, "vm_swap_bytes") == 0 && u(&s, "misses") > 0, "{s}");
}

/// Two contexts of one model decode prompts of several ubatches at once, on
/// two threads of one Python process, with their groups' expert ops shared
/// (`SDQ_GROUP_SHARE=1`): each answers as llama-completion does with the same
/// settings, every time. The shared layer's buffers belong to the group on
/// one thread; the other thread's group computes its own experts meanwhile.
#[test]
fn two_contexts_decoding_prompt_groups_at_once_answer_as_stock() {
    let python = venv();
    let model = tiny_preset();
    let prompt = vec![PROMPT; 24].join(", ");
    let settings = ["-c", "512", "-b", "512", "-ub", "32", "-t", "2", "-fa", "off", "--repeat-penalty", "1"];
    let o = run(
        Command::new(bin("llama-completion"))
            .args(["-m", model.to_str().unwrap(), "-p", &prompt, "-n", "12", "--top-k", "1", "-no-cnv", "--no-display-prompt"])
            .args(settings),
        300,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let want = stdout(&o).trim_end().to_string();
    let script = r#"
import sys, threading
from llama_cpp import Llama
path, prompt = sys.argv[1:3]
kw = dict(n_ctx=512, n_batch=512, n_ubatch=32, n_threads=2, flash_attn=False, verbose=False, seed=1)
llms = [Llama(model_path=path, **kw) for _ in range(2)]
texts = [[], []]
def work(i):
    for _ in range(3):
        llms[i].reset()
        out = llms[i].create_completion(prompt, max_tokens=12, top_k=1, temperature=0.0, repeat_penalty=1.0)
        texts[i].append(out["choices"][0]["text"])
threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
for i in range(2):
    for j, t in enumerate(texts[i]):
        sys.stdout.write("%d.%d: %s\n@@\n" % (i, j, t))
"#;
    let stats = scratch().join("library-two-threads-stats.json");
    let _ = std::fs::remove_file(&stats);
    let o = run(
        Command::new(&python).args(["-c", script, model.to_str().unwrap(), &prompt]).env("LLAMA_CPP_LIB_PATH", lib_dir()).envs([
            ("SDQ_RAM_BUDGET", "400M"),
            ("SDQ_GROUP_SHARE", "1"),
            ("SDQ_PRELOAD", "0"),
            ("SDQ_STATS_FILE", stats.to_str().unwrap()),
        ]),
        300,
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for label in ["0.0", "0.1", "0.2", "1.0", "1.1", "1.2"] {
        assert_eq!(labelled(&out, label).as_ref(), Some(&want), "context {label}: {out}");
    }
    let s: Value = read_json(&stats);
    let g = &s["prompt_groups"];
    assert!(u(g, "groups") >= 2 && u(g, "shared") > 0 && u(g, "shared_layers") > 0, "the prompts were not shared groups: {s}");
}

/// With `MTMD_CPP_LIB` at sdq's libmtmd.so, a chat with an image on the
/// generated MiniCPM-V projector answers as llama-mtmd-cli does, under a
/// budget whose arena is a few slots (the run's own minimum plus 2 MiB: at
/// 150 MiB the context is refused, naming the minimum for the model and its
/// context; the first batch names it with the projector loaded too, if
/// that is more). The generated model's chat template is plain ChatML, which takes string content: the script gives it the media marker
/// and the text, as llama-mtmd-cli does.
#[test]
fn llama_cpp_python_chats_with_an_image_under_a_budget() {
    let python = venv();
    let (model, mmproj) = crate::vision::vision_model();
    let image = crate::vision::image();
    let (out, err, code) = crate::vision::describe(&["-c", "2048", "-fa", "off"]);
    assert_eq!(code, Some(0), "{err}");
    let expected = out.trim().to_string();
    assert!(!expected.is_empty(), "llama-mtmd-cli answered nothing: {err}");
    let script = r#"
import sys, base64
from llama_cpp import Llama
from llama_cpp.llama_chat_format import MTMDChatHandler

class TextContentHandler(MTMDChatHandler):
    def _get_template_messages(self, messages, media_marker):
        out = []
        for m in super()._get_template_messages(messages, media_marker):
            if isinstance(m.get("content"), list):
                m["content"] = "".join(p["text"] for p in m["content"])
            out.append(m)
        return out

model, mmproj, img = sys.argv[1:4]
try:
    llm = Llama(model_path=model, chat_handler=TextContentHandler(clip_model_path=mmproj, verbose=False), n_ctx=2048, n_batch=2048, n_ubatch=512, n_threads=2, flash_attn=False, verbose=False, seed=1)
except ValueError as e:
    sys.stdout.write("ValueError " + str(e))
    sys.exit(0)
url = "data:image/png;base64," + base64.b64encode(open(img, "rb").read()).decode()
try:
    r = llm.create_chat_completion(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the picture"}]}], max_tokens=16, top_k=1, temperature=0.0, repeat_penalty=1.0)
    sys.stdout.write("answer: " + r["choices"][0]["message"]["content"])
except RuntimeError as e:
    sys.stdout.write("RuntimeError " + str(e))
llm.close()
"#;
    let chat = |budget: &str, stats: &Path| {
        let o = run(
            Command::new(&python)
                .args(["-c", script, model.to_str().unwrap(), mmproj.to_str().unwrap(), image.to_str().unwrap()])
                .env("LLAMA_CPP_LIB_PATH", lib_dir())
                .env("MTMD_CPP_LIB", lib_dir())
                .envs([("SDQ_RAM_BUDGET", budget), ("SDQ_STATS_FILE", stats.to_str().unwrap()), ("SDQ_PRELOAD", "0")]),
            300,
        );
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
        (stdout(&o), stderr(&o))
    };
    let stats = scratch().join("library-mtmd-stats.json");
    // Too small for the model and its context: `Llama(...)` raises.
    let (out, err) = chat("150M", &stats);
    assert!(out.contains("ValueError Failed to create llama_context") && err.contains("is too small"), "{out}{err}");
    // Room for those may still be too little once the projector has loaded
    // beside them: then the chat's first batch fails, naming the minimum.
    let mut budget = crate::vision::min_budget_in(&err) + (2 << 20);
    let (mut out, mut err) = chat(&budget.to_string(), &stats);
    if out.starts_with("RuntimeError") {
        assert!(out.contains("RuntimeError llama_decode returned 2") && err.contains("is too small"), "{out}{err}");
        budget = crate::vision::min_budget_in(&err) + (2 << 20);
        (out, err) = chat(&budget.to_string(), &stats);
    }
    assert_eq!(out.strip_prefix("answer: ").map(str::trim), Some(expected.as_str()), "{err}");
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0 && u(&s, "peak_rss_anon_bytes") <= budget && u(&s, "vm_swap_bytes") == 0, "{s}");
}
