//! `sdq gen-model`: writes real MoE GGUF models (ggml's gguf writer and
//! quantizers, random weights with trained-looking skewed routing), streaming
//! tensor data so a model of any size is written in bounded memory.

mod fill;
mod mmproj;
mod spec;

pub use mmproj::{Projector, IMAGE_TOKENS};
pub use spec::{Arch, Family, Fill, Mixer, ModelSpec, PlannedTensor, Recurrent, Router, Shared, FAMILIES, PRESETS};

use crate::error::{Error, Result};
use crate::gguf::{Array, Gguf, GgufBuilder, Value};
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `general.file_type` of a Q4_K_M model (LLAMA_FTYPE_MOSTLY_Q4_K_M).
const FTYPE_MOSTLY_Q4_K_M: u32 = 15;

/// The vocabulary the generated models' tokenizer is copied from.
pub fn default_vocab_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("vendor/llama.cpp/models/ggml-vocab-qwen35.gguf")
}

/// Where and how to write.
#[derive(Clone, Debug)]
pub struct GenOptions {
    pub out: PathBuf,
    /// GGUF whose `tokenizer.*` keys are copied (padded to the model's vocabulary).
    pub vocab_file: PathBuf,
    pub threads: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// A name recorded as `general.name` and `sdq.preset`.
    pub preset: String,
    /// Give the first four padding tokens MiniCPM-V's image tokens
    /// (`IMAGE_TOKENS`), which a projector's template needs.
    pub image_tokens: bool,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct GenReport {
    pub path: PathBuf,
    pub bytes: u64,
    pub tensors: usize,
    pub seconds: f64,
}

/// Writes the model `spec` to `opts.out` (through a temporary file renamed at
/// the end, so a failed run never leaves a partial model under that name).
pub fn generate(spec: &ModelSpec, opts: &GenOptions) -> Result<GenReport> {
    spec.validate()?;
    let plan = spec.plan();
    let mut builder = GgufBuilder::new(plan.len());
    write_metadata(spec, opts, &mut builder)?;
    write_file(spec, &plan, builder, opts)
}

/// Writes a MiniCPM-V 4.6 projector for the text model `spec` to `opts.out`.
pub fn generate_mmproj(spec: &ModelSpec, opts: &GenOptions, size: &str) -> Result<GenReport> {
    let projector = Projector::named(size, spec)?;
    let plan = projector.plan();
    let mut builder = GgufBuilder::new(plan.len());
    projector.write_metadata(&mut builder);
    write_file(spec, &plan, builder, opts)
}

/// Writes `plan`'s tensors after `builder`'s keys (filled as `spec`'s seed says).
fn write_file(spec: &ModelSpec, plan: &[PlannedTensor], mut builder: GgufBuilder, opts: &GenOptions) -> Result<GenReport> {
    let start = Instant::now();
    for t in plan {
        builder.add_tensor(&t.name, t.ty, &t.ne);
    }
    let meta = builder.meta_bytes();
    let align = builder.alignment();
    let data_bytes = builder.tensor_offset(plan.len() - 1) + padded(plan.last().unwrap().nbytes(), align);
    let total = meta.len() as u64 + data_bytes;

    let tmp = opts.out.with_extension("gguf.partial");
    check_free_space(&opts.out, total)?;
    let file = File::create(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    let io = |e| Error::io("writing", &tmp, e);
    w.write_all(&meta).map_err(io)?;

    let mut progress = Progress::new(total, opts.progress);
    let mut tensors = fill::TensorWriter::new(spec, opts.threads);
    let mut pos = meta.len() as u64;
    for (i, t) in plan.iter().enumerate() {
        let at = meta.len() as u64 + builder.tensor_offset(i);
        assert!(at >= pos, "tensor {} at {at} overlaps the previous one ending at {pos}", t.name);
        w.write_all(&vec![0u8; (at - pos) as usize]).map_err(io)?;
        tensors.write(t, &mut |chunk| {
            progress.advance(chunk.len() as u64);
            w.write_all(chunk)
        })
        .map_err(io)?;
        pos = at + t.nbytes();
    }
    w.write_all(&vec![0u8; (meta.len() as u64 + data_bytes - pos) as usize]).map_err(io)?;
    let mut file = w.into_inner().map_err(|e| Error::io("writing", &tmp, e.into_error()))?;
    let written = file.stream_position().map_err(io)?;
    assert_eq!(written, total, "wrote {written} bytes, planned {total}");
    file.seek(SeekFrom::Start(0)).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    progress.finish();
    std::fs::rename(&tmp, &opts.out).map_err(|e| Error::io("cannot rename to", &opts.out, e))?;

    Ok(GenReport { path: opts.out.clone(), bytes: total, tensors: plan.len(), seconds: start.elapsed().as_secs_f64() })
}

/// Refuses before writing when the output's file system cannot hold the
/// model: a disk that fills halfway through is a long wait for an error.
fn check_free_space(out: &Path, need: u64) -> Result<()> {
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(free) = free_bytes(dir) else { return Ok(()) };
    // The old file under that name, if any, is replaced only at the end.
    if free < need {
        return Err(Error::invalid(format!(
            "not enough free space for {}: the model needs {}, and {} has {} free",
            out.display(),
            crate::budget::human(need),
            dir.display(),
            crate::budget::human(free)
        )));
    }
    Ok(())
}

/// Bytes an unprivileged writer can still put on `dir`'s file system.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: zeroed is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path and st a statvfs we own.
    let ok = unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0;
    ok.then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn padded(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

fn write_metadata(spec: &ModelSpec, opts: &GenOptions, b: &mut GgufBuilder) -> Result<()> {
    let f = spec.family();
    let arch = f.name;
    let k = |key: &str| format!("{arch}.{key}");
    let u32v = |v: i64| Value::U32(u32::try_from(v).expect("validated geometry fits u32"));

    b.set("general.architecture", &Value::Str(arch.into()));
    b.set("general.name", &Value::Str(format!("sdq generated {}", opts.preset)));
    b.set("general.file_type", &Value::U32(FTYPE_MOSTLY_Q4_K_M));
    b.set("general.quantization_version", &Value::U32(2));
    b.set("sdq.preset", &Value::Str(opts.preset.clone()));
    b.set("sdq.seed", &Value::U64(spec.seed));

    b.set(&k("block_count"), &u32v(spec.n_block() as i64));
    b.set(&k("context_length"), &Value::U32(spec.context_length));
    b.set(&k("embedding_length"), &u32v(spec.n_embd));
    // Mixtral's experts are its FFN; families with dense layers give those.
    let n_ff = match f.shared {
        Shared::DenseMlp => spec.n_ff_dense,
        _ if spec.n_layer_dense_lead > 0 => spec.n_ff_dense,
        _ => spec.n_ff_exp,
    };
    b.set(&k("feed_forward_length"), &u32v(n_ff));
    b.set(&k("attention.head_count"), &u32v(spec.n_head));
    b.set(&k("attention.head_count_kv"), &u32v(spec.n_head_kv));
    if f.mixer == Mixer::Latent {
        // Converted MLA files: the cache holds the latent (kv rank) plus the
        // rotary part; the decompressed head sizes are the _mla keys.
        b.set(&k("attention.key_length"), &u32v(spec.kv_lora_rank + spec.rope_dim()));
        b.set(&k("attention.value_length"), &u32v(spec.kv_lora_rank));
        b.set(&k("attention.key_length_mla"), &u32v(spec.head_dim));
        b.set(&k("attention.value_length_mla"), &u32v(spec.mla_value_dim()));
        b.set(&k("attention.q_lora_rank"), &u32v(spec.q_lora_rank));
        b.set(&k("attention.kv_lora_rank"), &u32v(spec.kv_lora_rank));
    } else {
        b.set(&k("attention.key_length"), &u32v(spec.head_dim));
        b.set(&k("attention.value_length"), &u32v(spec.head_dim));
    }
    b.set(&k("attention.layer_norm_rms_epsilon"), &Value::F32(1e-6));
    b.set(&k("rope.freq_base"), &Value::F32(f.rope_freq_base));
    b.set(&k("rope.dimension_count"), &u32v(spec.rope_dim()));
    b.set(&k("expert_count"), &u32v(spec.n_expert));
    b.set(&k("expert_used_count"), &u32v(spec.n_expert_used));
    b.set(&k("expert_feed_forward_length"), &u32v(spec.n_ff_exp));
    if spec.n_layer_dense_lead > 0 {
        b.set(&k("leading_dense_block_count"), &Value::U32(spec.n_layer_dense_lead));
    }
    if spec.n_nextn > 0 {
        b.set(&k("nextn_predict_layers"), &Value::U32(spec.n_nextn));
    }
    match f.shared {
        Shared::Gated => b.set(&k("expert_shared_feed_forward_length"), &u32v(spec.n_ff_shexp)),
        Shared::Counted => b.set(&k("expert_shared_count"), &u32v(spec.n_expert_shared)),
        Shared::None | Shared::DenseMlp => {}
    }
    if f.router == Router::SigmoidBias {
        const GATING_SIGMOID: u32 = 2;
        b.set(&k("expert_gating_func"), &Value::U32(GATING_SIGMOID));
        b.set(&k("expert_weights_norm"), &Value::Bool(true));
        b.set(&k("expert_weights_scale"), &Value::F32(2.5));
        if spec.expert_groups > 1 {
            b.set(&k("expert_group_count"), &u32v(spec.expert_groups));
            b.set(&k("expert_group_used_count"), &u32v(spec.expert_groups_used));
        }
    }
    if f.sliding_window {
        b.set(&k("attention.sliding_window"), &Value::U32(spec.sliding_window));
    }
    if f.arch == Arch::Gemma4 {
        let swa = (0..spec.n_layer).map(|il| spec.is_swa(il)).collect();
        b.set(&k("attention.sliding_window_pattern"), &Value::Array(Array::Bool(swa)));
        b.set(&k("attention.key_length_swa"), &u32v(spec.head_dim));
        b.set(&k("attention.value_length_swa"), &u32v(spec.head_dim));
        b.set(&k("rope.dimension_count_swa"), &u32v(spec.rope_dim()));
        b.set(&k("rope.freq_base_swa"), &Value::F32(10_000.0));
        b.set(&k("embedding_length_per_layer_input"), &Value::U32(0));
        b.set(&k("final_logit_softcapping"), &Value::F32(30.0));
    }
    if let Mixer::Hybrid(kind) = f.mixer {
        b.set(&k("ssm.conv_kernel"), &u32v(spec.conv_kernel));
        b.set(&k("ssm.state_size"), &u32v(spec.ssm_head_dim));
        b.set(&k("ssm.group_count"), &u32v(spec.ssm_k_heads));
        b.set(&k("ssm.time_step_rank"), &u32v(spec.ssm_v_heads));
        b.set(&k("ssm.inner_size"), &u32v(spec.ssm_value_dim()));
        b.set(&k("full_attention_interval"), &Value::U32(spec.full_attention_interval));
        if kind == Recurrent::Qwen35 {
            let sections = spec.rope_sections().expect("validated");
            b.set(&k("rope.dimension_sections"), &Value::Array(Array::I32(sections.to_vec())));
            let recurrent = (0..spec.n_layer).map(|il| spec.is_recurrent(il)).collect();
            b.set(&k("attention.recurrent_layers"), &Value::Array(Array::Bool(recurrent)));
        }
    }
    copy_tokenizer(spec, opts, b)
}

/// Copies the `tokenizer.*` keys of `vocab_file`, padding the token list with
/// unused `[PADn]` tokens up to the model's vocabulary size.
fn copy_tokenizer(spec: &ModelSpec, opts: &GenOptions, b: &mut GgufBuilder) -> Result<()> {
    let vocab_file = opts.vocab_file.as_path();
    let vocab = Gguf::open(vocab_file)?;
    let n_tokens = match vocab.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a.len(),
        _ => return Err(Error::gguf(vocab_file, "has no tokenizer.ggml.tokens array")),
    };
    if spec.n_vocab < n_tokens {
        return Err(Error::invalid(format!(
            "vocabulary {} is smaller than the tokenizer's {n_tokens} tokens in {}",
            spec.n_vocab,
            vocab_file.display()
        )));
    }
    let pad = spec.n_vocab - n_tokens;
    if opts.image_tokens && pad < IMAGE_TOKENS.len() {
        return Err(Error::invalid(format!(
            "vocabulary {} leaves no room for the {} image tokens after the tokenizer's {n_tokens} (give --vocab {} or more)",
            spec.n_vocab,
            IMAGE_TOKENS.len(),
            n_tokens + IMAGE_TOKENS.len()
        )));
    }
    let name = |i: usize| match i.checked_sub(n_tokens) {
        Some(j) if opts.image_tokens && j < IMAGE_TOKENS.len() => IMAGE_TOKENS[j].to_string(),
        _ => format!("[PAD{i}]"),
    };
    for key in vocab.keys().into_iter().filter(|k| k.starts_with("tokenizer.")) {
        let value = match (key.as_str(), vocab.get(&key).expect("listed key")) {
            ("tokenizer.ggml.tokens", Value::Array(Array::Str(mut v))) => {
                v.extend((n_tokens..spec.n_vocab).map(name));
                Value::Array(Array::Str(v))
            }
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(mut v))) => {
                const TOKEN_TYPE_USER_DEFINED: i32 = 4;
                const TOKEN_TYPE_UNUSED: i32 = 5;
                let image = if opts.image_tokens { IMAGE_TOKENS.len() } else { 0 };
                v.extend(std::iter::repeat(TOKEN_TYPE_USER_DEFINED).take(image));
                v.extend(std::iter::repeat(TOKEN_TYPE_UNUSED).take(pad - image));
                Value::Array(Array::I32(v))
            }
            ("tokenizer.ggml.scores", Value::Array(Array::F32(mut v))) => {
                v.extend(std::iter::repeat(0.0).take(pad));
                Value::Array(Array::F32(v))
            }
            (_, v) => v,
        };
        b.set(&key, &value);
    }
    Ok(())
}

/// A one-line progress bar on stderr (or nothing).
struct Progress {
    total: u64,
    done: u64,
    enabled: bool,
    start: Instant,
    last_draw: Instant,
}

impl Progress {
    fn new(total: u64, enabled: bool) -> Progress {
        let enabled = enabled && std::io::stderr().is_terminal();
        Progress { total, done: 0, enabled, start: Instant::now(), last_draw: Instant::now() }
    }

    fn advance(&mut self, n: u64) {
        self.done += n;
        if self.enabled && self.last_draw.elapsed().as_millis() >= 200 {
            self.last_draw = Instant::now();
            self.draw();
        }
    }

    fn draw(&self) {
        const WIDTH: usize = 30;
        let frac = self.done as f64 / self.total.max(1) as f64;
        let filled = ((frac * WIDTH as f64) as usize).min(WIDTH);
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        eprint!(
            "\r[{}{}] {:5.1}% {:.2}/{:.2} GB {:.0} MB/s ",
            "#".repeat(filled),
            " ".repeat(WIDTH - filled),
            frac * 100.0,
            self.done as f64 / 1e9,
            self.total as f64 / 1e9,
            self.done as f64 / 1e6 / secs
        );
    }

    fn finish(&self) {
        if self.enabled {
            self.draw();
            eprintln!();
        }
    }
}
