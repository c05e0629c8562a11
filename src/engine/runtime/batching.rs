//! The logical batch (`-b`) sdq gives llama-completion and llama-cli under a
//! budget when the user gives none.
//!
//! Each `llama_decode` reads the experts its ubatches touch (they are
//! computed layer by layer across the batch, see `groups`), so a prompt cut
//! every 2,048 tokens, stock's `-b`, reads them once per cut: a prompt of
//! 2,115 tokens reads most of them twice, the second time for 67 tokens.
//! Given whole it reads them once. Stock cuts the prompt every 2,048 tokens
//! and each cut every `-ub`; where `-ub` divides 2,048, cutting every
//! multiple of `-ub` gives the same ubatches, and so the same values.
//!
//! llama-server is left alone: its batches mix the tokens of every slot
//! (one slot's prompt beside another's decode), and a larger `-b` would mix
//! them differently. So is a tool that drafts (MTP asks logits at every
//! prompt position, `n_vocab` floats a token of the batch), and one that
//! moves its cache between batches: llama-completion's context shift and
//! self-extend (`--context-shift`, `-gan`) act before each batch, so where
//! the batches are cut decides where they act.

use crate::engine::memory::growth;
use crate::error::Result;

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
}

impl BatchFlags {
    pub fn from_args_and_env(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> Result<BatchFlags> {
        Ok(BatchFlags {
            batch: growth::flag_value(args, &["-b", "--batch-size"], "LLAMA_ARG_BATCH", getenv)?,
            ubatch: growth::flag_value(args, &["-ub", "--ubatch-size"], "LLAMA_ARG_UBATCH", getenv)?,
            ctx: growth::flag_value(args, &["-c", "--ctx-size"], "LLAMA_ARG_CTX_SIZE", getenv)?,
            speculative: growth::speculative(args, getenv),
            moves_cache: context_shift(args, getenv)
                || growth::flag_value(args, &["-gan", "--grp-attn-n"], "LLAMA_ARG_GRP_ATTN_N", getenv)?.is_some_and(|n| n != 1),
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
        let ubatch = self.ubatch.unwrap_or(STOCK_UBATCH);
        if self.batch.is_some() || self.speculative || self.moves_cache || ubatch <= 0 || STOCK_BATCH % ubatch != 0 {
            return None;
        }
        let ctx = self.ctx.filter(|&c| c > STOCK_BATCH)?;
        Some(ctx / ubatch * ubatch).filter(|&b| b > STOCK_BATCH)
    }
}

/// Whether `--context-shift` is on: the last of it and `--no-context-shift`
/// on the command line, else `LLAMA_ARG_CONTEXT_SHIFT` set to anything but
/// a false value (off by default).
fn context_shift(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> bool {
    let last = args.iter().skip(1).rev().find(|a| *a == "--context-shift" || *a == "--no-context-shift");
    match last {
        Some(a) => a == "--context-shift",
        None => getenv("LLAMA_ARG_CONTEXT_SHIFT").is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false" | "off" | "disabled")),
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
    fn a_flag_that_is_not_a_number_is_an_error_naming_it() {
        let args: Vec<String> = ["llama-completion", "-c", "4k"].iter().map(|s| s.to_string()).collect();
        let e = BatchFlags::from_args_and_env(&args, &|_| None).unwrap_err().to_string();
        assert!(e.contains("-c") && e.contains("4k"), "{e}");
    }
}
