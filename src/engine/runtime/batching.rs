//! The logical batch (`-b`) sdq gives a tool under a budget when the user
//! gives none.
//!
//! Each `llama_decode` reads the experts its ubatches touch (they are
//! computed layer by layer across the batch, see `groups`), so a prompt cut
//! every 2,048 tokens, stock's `-b`, reads them once per cut: a prompt of
//! 2,115 tokens reads most of them twice, the second time for 67 tokens.
//! Given whole it reads them once. Stock cuts the prompt every 2,048 tokens
//! and each cut every `-ub`; where `-ub` divides 2,048, cutting every
//! multiple of `-ub` gives the same ubatches, and so the same values.
//!
//! llama-completion and llama-cli get `-b` of the context. llama-server gets
//! it too, but its batches hold the tokens of every slot (one slot's prompt
//! beside another's decode): there the raised `-b` is for a prompt alone in
//! its batch, and a batch that holds other slots' tokens is held to stock's
//! (`shared_batch`, read by patch 0016), so the others' decode goes on
//! between a long prompt's pieces as in stock. Left alone: a tool that
//! drafts (MTP asks logits at every prompt position, `n_vocab` floats a
//! token of the batch), one that moves its cache between batches
//! (llama-completion's context shift and self-extend, `--context-shift` and
//! `-gan`, act before each batch, so where the batches are cut decides where
//! they act), and llama-server's embeddings and reranking (a prompt there is
//! one ubatch, and the server sets `-b` to `-ub` itself).

use crate::engine::memory::growth;
use crate::error::Result;
use std::sync::atomic::{AtomicI32, Ordering};

/// Stock llama.cpp's `-b` and `-ub` (`common_params::n_batch`, `n_ubatch`).
pub const STOCK_BATCH: i64 = 2048;
pub const STOCK_UBATCH: i64 = 512;

/// The flags that decide a tool's batches, as llama.cpp's parser reads them
/// (the last command-line occurrence, else the `LLAMA_ARG_*` variable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchFlags {
    /// `-b`, `-ub` and `-c`, if set.
    pub batch: Option<i64>,
    pub ubatch: Option<i64>,
    pub ctx: Option<i64>,
    /// The tool drafts (`growth::speculative`).
    pub speculative: bool,
    /// `--context-shift` is on, or `-gan` is not 1.
    pub moves_cache: bool,
    /// llama-server computes embeddings or reranks (`--embeddings`, `--rerank`).
    pub embeddings: bool,
}

impl BatchFlags {
    pub fn from_args_and_env(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> Result<BatchFlags> {
        Ok(BatchFlags {
            batch: growth::flag_value(args, &["-b", "--batch-size"], "LLAMA_ARG_BATCH", getenv)?,
            ubatch: growth::flag_value(args, &["-ub", "--ubatch-size"], "LLAMA_ARG_UBATCH", getenv)?,
            ctx: growth::flag_value(args, &["-c", "--ctx-size"], "LLAMA_ARG_CTX_SIZE", getenv)?,
            speculative: growth::speculative(args, getenv),
            moves_cache: switched_on(args, &["--context-shift"], &["--no-context-shift"], "LLAMA_ARG_CONTEXT_SHIFT", getenv)
                || growth::flag_value(args, &["-gan", "--grp-attn-n"], "LLAMA_ARG_GRP_ATTN_N", getenv)?.is_some_and(|n| n != 1),
            embeddings: switched_on(args, &["--embedding", "--embeddings"], &[], "LLAMA_ARG_EMBEDDINGS", getenv)
                || switched_on(args, &["--rerank", "--reranking"], &[], "LLAMA_ARG_RERANKING", getenv),
        })
    }

    /// The `-b` that gives a prompt as large as the context to one
    /// `llama_decode`: the context rounded down to a multiple of `-ub`.
    /// None where the user set `-b`, the tool drafts or moves its cache
    /// between batches, `-ub` does not divide stock's `-b` (the ubatches
    /// would differ), or the context is unset (`-c 0`: the model's, which
    /// llama.cpp may lower to fit the machine's memory after this is
    /// decided) or no larger than stock's `-b`.
    ///
    /// Rounded down, not up: llama.cpp caps its batch at the context asked
    /// for, while a prompt may fill the context rounded up to 256 tokens, so
    /// a `-b` past `-c` could be handed a batch the context refuses. A
    /// prompt past the rounded-down `-b` is cut there, at a multiple of
    /// `-ub`, as stock cuts it at 2,048.
    pub fn whole_prompt_batch(&self) -> Option<i64> {
        self.raised(self.ctx)
    }

    /// llama-server's `-b` for a prompt alone in its batch: as
    /// `whole_prompt_batch`, of `-c`, or where it is not given (or 0) of the
    /// context the model was trained with, which llama.cpp takes then
    /// (llama.cpp caps its batch at the context it ends up with, and a
    /// server's prompt never outgrows its slot's context, so a batch alone
    /// is never cut at that cap). None with embeddings or reranking.
    pub fn lone_prompt_batch(&self, trained_context: Option<u64>) -> Option<i64> {
        if self.embeddings {
            return None;
        }
        let ctx = self.ctx.filter(|&c| c > 0).or_else(|| trained_context.and_then(|c| i64::try_from(c).ok()));
        self.raised(ctx)
    }

    fn raised(&self, ctx: Option<i64>) -> Option<i64> {
        let ubatch = self.ubatch.unwrap_or(STOCK_UBATCH);
        if self.batch.is_some() || self.speculative || self.moves_cache || ubatch <= 0 || STOCK_BATCH % ubatch != 0 {
            return None;
        }
        let ctx = ctx.filter(|&c| c > STOCK_BATCH)?;
        Some(ctx / ubatch * ubatch).filter(|&b| b > STOCK_BATCH)
    }
}

/// Stock's `-b` where sdq raised llama-server's for a prompt alone in its
/// batch (0 where it did not): a batch that holds other slots' tokens is
/// held to it. Set once, before the server starts.
static SHARED_BATCH: AtomicI32 = AtomicI32::new(0);

/// Says that llama-server's `-b` was raised (`lone_prompt_batch`).
pub fn raise_server_batch() {
    SHARED_BATCH.store(STOCK_BATCH as i32, Ordering::Relaxed);
}

/// The `-b` a llama-server batch holding several slots' tokens is held to,
/// or 0 where sdq left the server's `-b` alone.
pub fn shared_batch() -> i32 {
    SHARED_BATCH.load(Ordering::Relaxed)
}

/// Whether a switch that is off by default is on: the last of its `on` and
/// `off` flags on the command line, else `env` set to anything but a false
/// value.
fn switched_on(args: &[String], on: &[&str], off: &[&str], env: &str, getenv: &dyn Fn(&str) -> Option<String>) -> bool {
    let last = args.iter().skip(1).rev().find(|a| on.contains(&a.as_str()) || off.contains(&a.as_str()));
    match last {
        Some(a) => on.contains(&a.as_str()),
        None => getenv(env).is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "off" | "disabled")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(args: &[&str], env: &[(&str, &str)]) -> BatchFlags {
        let args: Vec<String> = std::iter::once("llama-completion").chain(args.iter().copied()).map(String::from).collect();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        BatchFlags::from_args_and_env(&args, &|k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())).unwrap()
    }

    #[test]
    fn the_context_becomes_the_batch_where_the_ubatches_stay_stocks() {
        assert_eq!(flags(&["-c", "4096"], &[]).whole_prompt_batch(), Some(4096));
        assert_eq!(flags(&["--ctx-size", "8448", "-ub", "256"], &[]).whole_prompt_batch(), Some(8448));
        assert_eq!(flags(&[], &[("LLAMA_ARG_CTX_SIZE", "16384")]).whole_prompt_batch(), Some(16384));
        // Rounded down to the ubatch, never past the context.
        assert_eq!(flags(&["-c", "5000"], &[]).whole_prompt_batch(), Some(4608));
        assert_eq!(flags(&["-c", "5000", "-ub", "64"], &[]).whole_prompt_batch(), Some(4992));
        assert_eq!(flags(&["-c", "4096", "--context-shift", "--no-context-shift", "-gan", "1"], &[]).whole_prompt_batch(), Some(4096));
        assert_eq!(flags(&["-c", "4096"], &[("LLAMA_ARG_CONTEXT_SHIFT", "false")]).whole_prompt_batch(), Some(4096));
    }

    #[test]
    fn what_the_user_set_or_stock_already_does_is_left_alone() {
        for (args, env) in [
            (&["-c", "4096", "-b", "1024"][..], &[][..]),
            (&["-c", "4096"][..], &[("LLAMA_ARG_BATCH", "2048")][..]),
            // -ub that does not divide 2,048: other ubatches than stock's.
            (&["-c", "4096", "-ub", "384"][..], &[][..]),
            (&["-c", "8192", "-ub", "4096"][..], &[][..]),
            (&["-c", "4096", "-ub", "0"][..], &[][..]),
            // The model's context, or one no larger than stock's -b.
            (&[][..], &[][..]),
            (&["-c", "0"][..], &[][..]),
            (&["-c", "2048"][..], &[][..]),
            (&["-c", "2300"][..], &[][..]),
            // Drafting.
            (&["-c", "4096", "--spec-type", "mtp"][..], &[][..]),
            (&["-c", "4096", "-md", "draft.gguf"][..], &[][..]),
            // The cache moved between batches.
            (&["-c", "4096", "--context-shift"][..], &[][..]),
            (&["-c", "4096"][..], &[("LLAMA_ARG_CONTEXT_SHIFT", "1")][..]),
            (&["-c", "4096", "-gan", "4"][..], &[][..]),
        ] {
            assert_eq!(flags(args, env).whole_prompt_batch(), None, "{args:?} {env:?}");
        }
    }

    #[test]
    fn the_server_takes_the_trained_context_where_c_is_not_given() {
        let trained = Some(131_072);
        assert_eq!(flags(&[], &[]).lone_prompt_batch(trained), Some(131_072));
        assert_eq!(flags(&["-c", "0"], &[]).lone_prompt_batch(trained), Some(131_072));
        assert_eq!(flags(&["-c", "8448"], &[]).lone_prompt_batch(trained), Some(8192));
        assert_eq!(flags(&[], &[]).lone_prompt_batch(Some(5000)), Some(4608));
        for (args, env) in [
            (&["-b", "2048"][..], &[][..]),
            (&["--embeddings"][..], &[][..]),
            (&["--rerank"][..], &[][..]),
            (&[][..], &[("LLAMA_ARG_EMBEDDINGS", "1")][..]),
            (&["-md", "draft.gguf"][..], &[][..]),
            (&["-ub", "384"][..], &[][..]),
        ] {
            assert_eq!(flags(args, env).lone_prompt_batch(trained), None, "{args:?} {env:?}");
        }
        // No context known, or none larger than stock's -b.
        assert_eq!(flags(&[], &[]).lone_prompt_batch(None), None);
        assert_eq!(flags(&[], &[]).lone_prompt_batch(Some(2048)), None);
        assert_eq!(flags(&["--embeddings", "--no-context-shift"], &[("LLAMA_ARG_EMBEDDINGS", "false")]).lone_prompt_batch(trained), None);
        assert_eq!(flags(&[], &[("LLAMA_ARG_EMBEDDINGS", "false")]).lone_prompt_batch(trained), Some(131_072));
    }

    #[test]
    fn a_flag_that_is_not_a_number_is_an_error_naming_it() {
        let args: Vec<String> = ["llama-completion", "-c", "4k"].iter().map(|s| s.to_string()).collect();
        let e = BatchFlags::from_args_and_env(&args, &|_| None).unwrap_err().to_string();
        assert!(e.contains("-c") && e.contains("4k"), "{e}");
    }
}
