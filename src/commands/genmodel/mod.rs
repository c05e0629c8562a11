//! `sdq gen-model`: writes real MoE GGUF models (ggml's gguf writer and
//! quantizers, random weights with trained-looking skewed routing), streaming
//! tensor data so a model of any size is written in bounded memory.

mod fill;
mod flags;
pub mod lora;
mod mmproj;
mod spec;

pub use flags::{run, GenModelArgs};
pub use mmproj::{Projector, IMAGE_TOKENS};
pub use spec::{Arch, Carrier, Family, Fill, Mixer, ModelSpec, PlannedTensor, Recurrent, RotaryRows, Router, Shared, FAMILIES, PRESETS};

use crate::engine::model::gguf::{Array, Gguf, GgufBuilder, Value};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `general.file_type` of a Q4_K_M model (LLAMA_FTYPE_MOSTLY_Q4_K_M).
const FTYPE_MOSTLY_Q4_K_M: u32 = 15;

/// The vocabulary the generated models' tokenizer is copied from.
pub fn default_vocab_file() -> PathBuf {
    vendored_vocab("qwen35")
}

/// The vendored tokenizer a model of `n_vocab` tokens takes: Qwen3.5's
/// (151,936 tokens) where it fits, else DeepSeek LLM's (102,400; DeepSeek-V3
/// has 129,280), padded with unused tokens in either case.
pub fn vocab_file_for(n_vocab: usize) -> PathBuf {
    const QWEN35_TOKENS: usize = 151_936;
    if n_vocab >= QWEN35_TOKENS {
        default_vocab_file()
    } else {
        vendored_vocab("deepseek-llm")
    }
}

fn vendored_vocab(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("vendor/llama.cpp/models/ggml-vocab-{name}.gguf"))
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
    /// Write parts of at most this many tensor bytes (`--split-max-size`).
    pub split_max_bytes: Option<u64>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct GenReport {
    /// The file to give llama.cpp: the first part of a split model.
    pub path: PathBuf,
    /// Every file written, in order.
    pub parts: Vec<PathBuf>,
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

/// Writes a LoRA adapter of rank `rank` for the model `spec` to `opts.out`.
pub fn generate_lora(spec: &ModelSpec, opts: &GenOptions, rank: i64) -> Result<GenReport> {
    lora::check_rank(rank)?;
    let plan = lora::plan(spec, rank);
    let mut builder = GgufBuilder::new(plan.len());
    lora::write_metadata(spec, rank, &mut builder);
    write_file(spec, &plan, builder, opts)
}

/// Writes `plan`'s tensors after `builder`'s keys (filled as `spec`'s seed
/// says): one file, or with `opts.split_max_bytes` the parts
/// `llama-gguf-split --split-max-size` would write (the keys in the first,
/// `split.*` in each, a new part where the next tensor would pass the size).
fn write_file(spec: &ModelSpec, plan: &[PlannedTensor], builder: GgufBuilder, opts: &GenOptions) -> Result<GenReport> {
    let start = Instant::now();
    let ranges = split_ranges(plan, opts.split_max_bytes);
    let n_parts = ranges.len();
    let count = u16::try_from(n_parts)
        .map_err(|_| Error::flag("--split-max-size", format!("--split-max-size makes {n_parts} parts, more than a split can count (65,535)")))?;
    let mut first = Some(builder);
    let mut parts = Vec::with_capacity(n_parts);
    for (i, range) in ranges.into_iter().enumerate() {
        let mut b = first.take().unwrap_or_else(|| GgufBuilder::new(range.len()));
        if n_parts > 1 {
            b.set("split.no", &Value::U16(i as u16));
            b.set("split.count", &Value::U16(count));
            b.set("split.tensors.count", &Value::I32(plan.len() as i32));
        }
        let tensors = &plan[range];
        for t in tensors {
            b.add_tensor(&t.name, t.ty, &t.ne);
        }
        parts.push(Part::new(part_path(&opts.out, i, n_parts), b, tensors));
    }
    let total: u64 = parts.iter().map(|p| p.size).sum();
    // An output path's directory is made, as a user expects of one.
    if let Some(dir) = opts.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create the directory", dir, e))?;
    }
    check_free_space(&opts.out, total)?;

    let mut progress = Progress::new(total, opts.progress);
    let mut writer = fill::TensorWriter::new(spec, opts.threads);
    for part in &parts {
        part.write(&mut writer, &mut progress)?;
    }
    progress.finish();
    Ok(GenReport {
        path: parts[0].path.clone(),
        parts: parts.into_iter().map(|p| p.path).collect(),
        bytes: total,
        tensors: plan.len(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The tensors of each part: all in one without a limit; otherwise a new
/// part wherever the next tensor's padded bytes would take the part's data
/// past `max` (a tensor larger than `max` gets a part of its own).
fn split_ranges(plan: &[PlannedTensor], max: Option<u64>) -> Vec<std::ops::Range<usize>> {
    let Some(max) = max else { return std::iter::once(0..plan.len()).collect() };
    let mut ranges = Vec::new();
    let (mut first, mut size) = (0, 0u64);
    for (i, t) in plan.iter().enumerate() {
        let n = padded(t.nbytes(), GGUF_ALIGNMENT);
        if i > first && size + n > max {
            ranges.push(first..i);
            (first, size) = (i, 0);
        }
        size += n;
    }
    ranges.push(first..plan.len());
    ranges
}

/// ggml's default GGUF alignment, which gguf-split also pads by.
const GGUF_ALIGNMENT: u64 = 32;

/// `llama_split_path`'s name for part `i` of `n`: `PREFIX-00001-of-00003.gguf`,
/// the prefix being `out` without its `.gguf`; `out` itself when unsplit.
pub fn part_path(out: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return out.to_path_buf();
    }
    let s = out.to_string_lossy();
    let prefix = s.strip_suffix(".gguf").unwrap_or(&s);
    PathBuf::from(format!("{prefix}-{:05}-of-{n:05}.gguf", i + 1))
}

/// One file to write: its metadata, serialized once, and its tensors.
struct Part<'a> {
    path: PathBuf,
    builder: GgufBuilder,
    tensors: &'a [PlannedTensor],
    meta: Vec<u8>,
    /// The file's bytes: metadata, then the tensors' padded data.
    size: u64,
}

impl<'a> Part<'a> {
    fn new(path: PathBuf, builder: GgufBuilder, tensors: &'a [PlannedTensor]) -> Part<'a> {
        let meta = builder.meta_bytes();
        let data = match tensors.last() {
            Some(last) => builder.tensor_offset(tensors.len() - 1) + padded(last.nbytes(), builder.alignment()),
            None => 0,
        };
        let size = meta.len() as u64 + data;
        Part { path, builder, tensors, meta, size }
    }

    /// Writes the metadata, then the tensors' data at the offsets the
    /// builder planned, through a temporary file renamed at the end.
    fn write(&self, tensors_out: &mut fill::TensorWriter, progress: &mut Progress) -> Result<()> {
        let (meta, out) = (&self.meta, self.path.as_path());
        let tmp = out.with_extension("gguf.partial");
        let file = File::create(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        let io = |e| Error::io("writing", &tmp, e);
        w.write_all(meta).map_err(io)?;
        let mut pos = meta.len() as u64;
        for (i, t) in self.tensors.iter().enumerate() {
            let at = meta.len() as u64 + self.builder.tensor_offset(i);
            assert!(at >= pos, "tensor {} at {at} overlaps the previous one ending at {pos}", t.name);
            w.write_all(&vec![0u8; (at - pos) as usize]).map_err(io)?;
            tensors_out
                .write(t, &mut |chunk| {
                    progress.advance(chunk.len() as u64);
                    w.write_all(chunk)
                })
                .map_err(io)?;
            pos = at + t.nbytes();
        }
        w.write_all(&vec![0u8; (self.size - pos) as usize]).map_err(io)?;
        let mut file = w.into_inner().map_err(|e| Error::io("writing", &tmp, e.into_error()))?;
        let written = file.stream_position().map_err(io)?;
        assert_eq!(written, self.size, "wrote {written} bytes, planned {}", self.size);
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename to", out, e))
    }
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
            crate::units::human(need),
            dir.display(),
            crate::units::human(free)
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
        let swa = (0..spec.n_block()).map(|il| spec.is_swa(il)).collect();
        b.set(&k("attention.sliding_window_pattern"), &Value::Array(Array::Bool(swa)));
        b.set(&k("attention.key_length_swa"), &u32v(spec.head_dim));
        b.set(&k("attention.value_length_swa"), &u32v(spec.head_dim));
        b.set(&k("rope.dimension_count_swa"), &u32v(spec.rope_dim()));
        b.set(&k("rope.freq_base_swa"), &Value::F32(spec::SWA_ROPE_FREQ_BASE));
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
            let recurrent = (0..spec.n_block()).map(|il| spec.is_recurrent(il)).collect();
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
        return Err(Error::invalid(format!("vocabulary {} is smaller than the tokenizer's {n_tokens} tokens in {}", spec.n_vocab, vocab_file.display())));
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
            stderr_line!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_cut_where_the_next_tensor_would_pass_the_size() {
        let spec = ModelSpec::preset("tiny").unwrap();
        let plan = spec.plan();
        assert_eq!(split_ranges(&plan, None), vec![0..plan.len()]);
        let max = 3 << 20;
        let ranges = split_ranges(&plan, Some(max));
        assert!(ranges.len() > 2, "{ranges:?}");
        assert_eq!(ranges.first().unwrap().start, 0);
        assert_eq!(ranges.last().unwrap().end, plan.len());
        for w in ranges.windows(2) {
            assert_eq!(w[0].end, w[1].start);
            let size = |r: &std::ops::Range<usize>| plan[r.clone()].iter().map(|t| padded(t.nbytes(), GGUF_ALIGNMENT)).sum::<u64>();
            // Each part is within the size unless one tensor alone passes it,
            // and the next part's first tensor would not have fitted.
            assert!(size(&w[0]) <= max || w[0].len() == 1);
            assert!(size(&w[0]) + padded(plan[w[1].start].nbytes(), GGUF_ALIGNMENT) > max);
        }
        assert_eq!(part_path(Path::new("m/a.gguf"), 0, 3), PathBuf::from("m/a-00001-of-00003.gguf"));
        assert_eq!(part_path(Path::new("m/a.gguf"), 0, 1), PathBuf::from("m/a.gguf"));
    }
}
