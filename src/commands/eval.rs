//! `sdq eval`: greedy decoding straight through llama.h, reporting the tokens,
//! the text and the final logits, so a budgeted run can be compared with a
//! stock one value by value (the upstream tools print no logits).

use crate::engine::ffi::sys;
use crate::error::{Error, Result};
use std::ffi::CString;
use std::path::Path;

/// How to run one greedy evaluation.
#[derive(Clone, Debug)]
pub struct EvalParams {
    pub prompt: String,
    pub n_predict: usize,
    pub threads: i32,
    pub n_ctx: u32,
    /// Physical batch: prompt tokens computed per graph.
    pub ubatch: u32,
    /// Logical batch: prompt tokens given to one llama_decode call (0: the
    /// ubatch), which splits them into ubatches.
    pub batch: u32,
    /// Allow llama.cpp's repacked CPU weight layouts (its default).
    pub repack: bool,
    /// Stop after loading the model and creating the context.
    pub load_only: bool,
}

/// What one evaluation produced.
#[derive(Clone, Debug)]
pub struct EvalResult {
    pub prompt_tokens: Vec<i32>,
    pub tokens: Vec<i32>,
    pub text: String,
    /// Logits after the last evaluated token.
    pub logits: Vec<f32>,
}

/// Owns a llama model and context; frees them in order.
struct Session {
    model: *mut sys::llama_model,
    ctx: *mut sys::llama_context,
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: both were created by llama.cpp and are freed once, context first.
        unsafe {
            if !self.ctx.is_null() {
                sys::llama_free(self.ctx);
            }
            if !self.model.is_null() {
                sys::llama_model_free(self.model);
            }
        }
    }
}

/// Loads `model` and decodes greedily.
pub fn run(model: &Path, p: &EvalParams) -> Result<EvalResult> {
    let cpath = CString::new(model.as_os_str().as_encoded_bytes()).map_err(|_| Error::invalid("model path contains NUL"))?;
    let cprompt = CString::new(p.prompt.as_str()).map_err(|_| Error::invalid("prompt contains NUL"))?;
    // SAFETY: every call below follows llama.h: the model and context stay
    // alive in `s` while used, buffers are sized by what llama.cpp reports,
    // and pointers passed in outlive each call.
    unsafe {
        sys::llama_log_set(Some(crate::engine::ffi::llama::quiet_log), std::ptr::null_mut());
        sys::llama_backend_init();
        let mut mp = sys::llama_model_default_params();
        mp.use_extra_bufts = p.repack;
        let mut s = Session { model: sys::llama_model_load_from_file(cpath.as_ptr(), mp), ctx: std::ptr::null_mut() };
        if s.model.is_null() {
            return Err(Error::gguf(model, "llama.cpp could not load the model"));
        }
        let mut cp = sys::llama_context_default_params();
        cp.n_ctx = p.n_ctx;
        let batch = if p.batch == 0 { p.ubatch } else { p.batch.max(p.ubatch) };
        cp.n_batch = batch;
        cp.n_ubatch = p.ubatch;
        cp.n_threads = p.threads;
        cp.n_threads_batch = p.threads;
        cp.no_perf = true;
        s.ctx = sys::llama_init_from_model(s.model, cp);
        if s.ctx.is_null() {
            return Err(Error::invalid("llama.cpp could not create a context"));
        }
        let vocab = sys::llama_model_get_vocab(s.model);
        if p.load_only {
            return Ok(EvalResult { prompt_tokens: vec![], tokens: vec![], text: String::new(), logits: vec![] });
        }
        let n_vocab = sys::llama_vocab_n_tokens(vocab) as usize;

        let cap = p.prompt.len() as i32 + 8;
        let mut prompt = vec![0i32; cap as usize];
        let n = sys::llama_tokenize(vocab, cprompt.as_ptr(), p.prompt.len() as i32, prompt.as_mut_ptr(), cap, true, false);
        if n < 0 {
            return Err(Error::invalid("prompt does not tokenize"));
        }
        prompt.truncate(n as usize);
        if prompt.len() + p.n_predict > p.n_ctx as usize {
            return Err(Error::invalid(format!("{} prompt + {} new tokens exceed the context of {}", prompt.len(), p.n_predict, p.n_ctx)));
        }

        let decode = |tokens: &mut [i32]| -> Result<()> {
            for chunk in tokens.chunks_mut(batch as usize) {
                let rc = sys::llama_decode(s.ctx, sys::llama_batch_get_one(chunk.as_mut_ptr(), chunk.len() as i32));
                if rc != 0 {
                    return Err(Error::invalid(format!("llama_decode failed ({rc})")));
                }
            }
            Ok(())
        };
        let logits = |ctx| std::slice::from_raw_parts(sys::llama_get_logits_ith(ctx, -1), n_vocab).to_vec();

        decode(&mut prompt.clone())?;
        let mut last = logits(s.ctx);
        let mut tokens = Vec::new();
        let mut text = Vec::new();
        for i in 0..p.n_predict {
            let next = last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(t, _)| t as i32).unwrap_or(0);
            tokens.push(next);
            let mut piece = [0u8; 256];
            let len = sys::llama_token_to_piece(vocab, next, piece.as_mut_ptr().cast(), piece.len() as i32, 0, false);
            text.extend_from_slice(&piece[..len.max(0) as usize]);
            if i + 1 == p.n_predict || sys::llama_vocab_is_eog(vocab, next) {
                break;
            }
            decode(&mut [next])?;
            last = logits(s.ctx);
        }
        Ok(EvalResult { prompt_tokens: prompt, tokens, text: String::from_utf8_lossy(&text).into_owned(), logits: last })
    }
}
