//! Hostile and wrong input under a budget: each gives one clear line naming
//! the file and what is wrong, exit 1, no panic and no output; a model
//! without routed experts runs as stock with a one-line notice.

use crate::util::*;
use sdq::engine::model::gguf::{GgufBuilder, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn completion_with_budget(model: &Path) -> std::process::Output {
    run(Command::new(bin("llama-completion")).args(completion_args(model, "Hello", 4)).args(["--ram-budget", "1G"]), 120)
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = scratch().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn broken_model_files_are_one_clear_line() {
    broken_model_files(tiny(), "qwen35moe");
}

/// The same on gpt-oss's layout (expert biases, sliding-window attention).
#[test]
fn broken_gpt_oss_files_are_one_clear_line() {
    broken_model_files(&crate::families::family_model("gpt-oss"), "gpt-oss");
}

fn broken_model_files(model: &Path, arch: &str) {
    let tiny_bytes = std::fs::read(model).unwrap();
    let mut bad_magic = tiny_bytes.clone();
    bad_magic[3] = b'X';
    let mut absurd = b"GGUF".to_vec();
    absurd.extend(3u32.to_le_bytes());
    absurd.extend((1u64 << 60).to_le_bytes()); // tensors
    absurd.extend((1u64 << 60).to_le_bytes()); // key-value pairs
                                               // The same file with another value for a u32 key (the key's string, its
                                               // type tag, then the value).
    let with_u32 = |key: &str, value: u32| {
        let at = tiny_bytes.windows(key.len()).position(|w| w == key.as_bytes()).expect("key in the model") + key.len();
        assert_eq!(tiny_bytes[at..at + 4], 4u32.to_le_bytes(), "{key} is a u32");
        let mut b = tiny_bytes.clone();
        b[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
        b
    };
    let cases: Vec<(PathBuf, String)> = vec![
        (
            write(&format!("{arch}-bad-top-k-0.gguf"), &with_u32(&format!("{arch}.expert_used_count"), 0)),
            "expert_used_count is 0: it must be between 1 and".to_string(),
        ),
        (
            write(&format!("{arch}-bad-top-k-huge.gguf"), &with_u32(&format!("{arch}.expert_used_count"), 1 << 30)),
            "expert_used_count is 1073741824".to_string(),
        ),
        (
            write(&format!("{arch}-bad-expert-count.gguf"), &with_u32(&format!("{arch}.expert_count"), 1 << 30)),
            format!("experts, but {arch}.expert_count is 1073741824"),
        ),
        (write(&format!("{arch}-bad-truncated-header.gguf"), &tiny_bytes[..100_000]), "not a valid GGUF file".to_string()),
        (write(&format!("{arch}-bad-truncated-data.gguf"), &tiny_bytes[..tiny_bytes.len() - 100_000]), "past the end of the file".to_string()),
        (write(&format!("{arch}-bad-magic.gguf"), &bad_magic), "not a GGUF file (starts with \"GGUX\"".to_string()),
        (write(&format!("{arch}-bad-absurd-counts.gguf"), &absurd), "not a valid GGUF file".to_string()),
        (write(&format!("{arch}-bad-empty.gguf"), b""), "too short for a GGUF file".to_string()),
        (scratch(), "not a regular file".to_string()),
        (PathBuf::from("/nonexistent/model.gguf"), "No such file or directory".to_string()),
    ];
    for (path, needle) in cases {
        let o = completion_with_budget(&path);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{}: {}\n{err}", path.display(), o.status);
        let last = err.lines().last().unwrap_or("");
        assert!(last.contains(&path.display().to_string()) && last.contains(&needle), "{}: {err}", path.display());
        assert!(!err.contains("panicked") && stdout(&o).is_empty(), "{}: {err}", path.display());
    }
}

#[test]
fn an_unreadable_model_file_is_named() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let model = scratch().join("unreadable.gguf");
    std::fs::copy(tiny(), &model).unwrap();
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o000)).unwrap();
    let mut c = Command::new(bin("llama-completion"));
    c.args(completion_args(&model, "Hello", 4)).args(["--ram-budget", "1G"]);
    // Root reads any file, so as root the tool runs as nobody.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        c.uid(65534).gid(65534);
    }
    let o = run(&mut c, 120);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{}\n{err}", o.status);
    let last = err.lines().last().unwrap_or("");
    assert!(last.contains(model.to_str().unwrap()) && last.contains("Permission denied"), "{err}");
    assert!(!err.contains("panicked") && stdout(&o).is_empty(), "{err}");
}

#[test]
fn a_split_model_with_a_part_missing_is_named() {
    let mut b = GgufBuilder::new(0);
    b.set("general.architecture", &Value::Str("qwen35moe".into()));
    b.set("split.no", &Value::U16(0));
    b.set("split.count", &Value::U16(3));
    let first = write("split-00001-of-00003.gguf", &b.meta_bytes());
    b.set("split.no", &Value::U16(1));
    write("split-00002-of-00003.gguf", &b.meta_bytes());
    let _ = std::fs::remove_file(scratch().join("split-00003-of-00003.gguf"));
    let o = completion_with_budget(&first);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("split part 3 of 3 is missing") && stderr(&o).contains("split-00003-of-00003.gguf"), "{}", stderr(&o));
}

#[test]
fn a_model_without_routed_experts_runs_as_stock_with_a_notice() {
    let dense = gen_model("dense-like.gguf", &["--preset", "tiny", "--layers", "4"]);
    // gen-model writes only MoE models; renaming the expert tensors in the
    // header (same length, so no offset moves) leaves a model without any.
    let header = sdq::engine::model::gguf::Gguf::open(&dense).unwrap().data_offset() as usize;
    let mut out = std::fs::read(&dense).unwrap();
    let mut i = 0;
    while let Some(pos) = find(&out[i..header], b"_exps.") {
        out[i + pos + 4] = b'z'; // "_exps." -> "_expz."
        i += pos + 6;
    }
    assert!(i > 0, "no expert tensor names found");
    let model = write("no-experts.gguf", &out);
    let o = run(Command::new(bin("llama-completion")).args(completion_args(&model, "Hello", 4)).args(["--ram-budget", "1G"]), 120);
    let err = stderr(&o);
    assert!(err.contains("sdq: notice: the model has no routed-expert tensors; --ram-budget is ignored"), "{err}");
    // llama.cpp itself refuses a qwen35moe without its expert tensors: what
    // matters is that sdq stepped aside and the error is upstream's own.
    assert!(!err.contains("sdq: hit"), "{err}");
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[test]
fn bad_budget_strings_are_clear_errors() {
    for (value, needle) in [("-1", "'-1'"), ("8X", "unknown unit"), ("0", "is zero"), ("99999T", "more than this machine's")] {
        let o = run(Command::new(bin("llama-completion")).args(completion_args(tiny(), "Hi", 4)).arg(format!("--ram-budget={value}")), 60);
        assert_eq!(o.status.code(), Some(1), "{value}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("--ram-budget") && err.contains(needle) && !err.contains("panicked"), "{value}: {err}");
    }
}
