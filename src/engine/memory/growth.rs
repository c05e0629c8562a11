//! The memory llama.cpp's own tools allocate after the model is loaded, and
//! which therefore is not in the arena plan: llama-server's (and llama-cli's)
//! prompt cache, 8 GiB by default, and its context checkpoints, which for a
//! model with recurrent layers copy each slot's recurrent state up to 32 times.
//! Under a budget both must fit in the reserve, or the budget is a fiction.
//!
//! When the user sets neither, sdq sets them from the reserve: the prompt
//! cache gets half of it and the checkpoints a quarter (at least one per
//! slot: none would change how the server splits a prompt, and so its
//! answers), which leaves a quarter for the rest of the growth after load
//! (measured at 25–30 MiB on the 35B-A3B geometry). When the user sets them, the reserve grows to hold what
//! they asked for, with a notice; an unlimited cache cannot be held to any
//! budget and is an error.

use crate::engine::model::gguf::Gguf;
use crate::error::{Error, Result};
use crate::units::{human, MIB};
use std::collections::BTreeSet;

/// Upstream's limit on checkpoints per slot (`common_params::n_ctx_checkpoints`).
pub const MAX_CHECKPOINTS: u64 = 32;
/// Slots llama-server uses when `--parallel` is left at auto.
const AUTO_SLOTS: u64 = 4;

/// The options of the tool's command line (or environment) that decide its growth.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolSettings {
    /// `--cache-ram` in MiB (-1 = no limit, 0 = off), if set.
    pub cache_ram_mib: Option<i64>,
    /// `--ctx-checkpoints`, if set.
    pub checkpoints: Option<i64>,
    /// `--parallel`, if set (-1 = auto).
    pub parallel: Option<i64>,
    /// Speculative decoding is asked for (`--spec-type` other than `none`,
    /// or a draft model): llama-server then keeps each slot's recurrent
    /// state once more, to roll back rejected drafts.
    pub speculative: bool,
}

/// A whole-number flag's value (`-f V` or `-f=V`, the last given), else the
/// `env` variable's; an error names the flag if it is not a number.
pub(crate) fn flag_value(args: &[String], names: &[&str], env: &str, getenv: &dyn Fn(&str) -> Option<String>) -> Result<Option<i64>> {
    let mut found: Option<(String, String)> = None;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        for n in names {
            if a == n {
                found = it.next().map(|v| (n.to_string(), v.clone()));
            } else if let Some(v) = a.strip_prefix(&format!("{n}=")) {
                found = Some((n.to_string(), v.to_string()));
            }
        }
    }
    let found = found.or_else(|| getenv(env).filter(|v| !v.is_empty()).map(|v| (env.to_string(), v)));
    match found {
        None => Ok(None),
        Some((name, v)) => v.trim().parse::<i64>().map(Some).map_err(|_| Error::flag(name.clone(), format!("{name}: '{v}' is not a whole number"))),
    }
}

impl ToolSettings {
    /// Reads the settings as llama.cpp's argument parser would: the last
    /// command-line occurrence, else the `LLAMA_ARG_*` environment variable.
    pub fn from_args_and_env(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> Result<ToolSettings> {
        Ok(ToolSettings {
            cache_ram_mib: flag_value(args, &["-cram", "--cache-ram"], "LLAMA_ARG_CACHE_RAM", getenv)?,
            checkpoints: flag_value(args, &["-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"], "LLAMA_ARG_CTX_CHECKPOINTS", getenv)?,
            parallel: flag_value(args, &["-np", "--parallel"], "LLAMA_ARG_N_PARALLEL", getenv)?,
            speculative: speculative(args, getenv),
        })
    }
}

/// Whether the tool drafts: `--spec-type` (or `LLAMA_ARG_SPEC_TYPE`) set to
/// anything but `none`, or a draft model (`-md`, `--model-draft`,
/// `LLAMA_ARG_MODEL_DRAFT`), as llama.cpp's parser reads them.
pub(crate) fn speculative(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> bool {
    let types = last_value(args, &["--spec-type"]).or_else(|| getenv("LLAMA_ARG_SPEC_TYPE"));
    draft_model(args, getenv).is_some() || types.is_some_and(|t| t.split(',').any(|t| !t.trim().is_empty() && t.trim() != "none"))
}

/// The draft model the tool loads (`-md`, `--model-draft`, or
/// `LLAMA_ARG_MODEL_DRAFT`), as llama.cpp's parser reads them.
pub fn draft_model(args: &[String], getenv: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    last_value(args, &["-md", "--model-draft"]).or_else(|| getenv("LLAMA_ARG_MODEL_DRAFT")).filter(|v| !v.is_empty())
}

/// The last value given to one of `flags` (`-f V` or `--flag=V`).
fn last_value(args: &[String], flags: &[&str]) -> Option<String> {
    let mut value = None;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if flags.contains(&a.as_str()) {
            value = it.next().cloned();
        } else if let Some(v) = flags.iter().filter(|f| f.starts_with("--")).find_map(|f| a.strip_prefix(f).and_then(|r| r.strip_prefix('='))) {
            value = Some(v.to_string());
        }
    }
    value
}

/// Bytes of one sequence's recurrent state (conv + SSM state, f32), summed
/// over the model's recurrent layers: the size of one context checkpoint.
/// Zero for a model without recurrent layers.
pub fn checkpoint_bytes(g: &Gguf) -> u64 {
    let key = |k: &str| g.arch_u64(&format!("ssm.{k}")).unwrap_or(0);
    let (d_conv, d_inner, n_group, d_state) = (key("conv_kernel"), key("inner_size"), key("group_count"), key("state_size"));
    let tensors = g.tensors();
    let mut recurrent = BTreeSet::new();
    for t in &tensors {
        if let Some(rest) = t.name.strip_prefix("blk.") {
            if let Some((layer, name)) = rest.split_once('.') {
                if name.starts_with("ssm_") {
                    recurrent.insert(layer);
                }
            }
        }
    }
    let conv = d_conv.saturating_sub(1).saturating_mul(d_inner.saturating_add(2u64.saturating_mul(n_group).saturating_mul(d_state)));
    let state = d_state.saturating_mul(d_inner);
    (recurrent.len() as u64).saturating_mul(conv.saturating_add(state)).saturating_mul(4)
}

/// What sdq does about the tool's growth: environment to set for it, and the
/// reserve that holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrowthPlan {
    /// The reserve to plan the arena with.
    pub reserve: u64,
    /// `LLAMA_ARG_*` variables to set (only for settings the user left alone).
    pub env: Vec<(&'static str, String)>,
    /// Prompt cache plus checkpoints, at most.
    pub bytes: u64,
    /// A line for the user when sdq chose a setting or raised the reserve.
    pub notice: Option<String>,
}

/// Fits the prompt cache and the checkpoints into `reserve` (see the module doc).
pub fn plan(settings: &ToolSettings, reserve: u64, checkpoint: u64) -> Result<GrowthPlan> {
    let slots = match settings.parallel {
        Some(n) if n > 0 => n as u64,
        _ => AUTO_SLOTS,
    };
    let mut env = Vec::new();
    let mut chosen = Vec::new();
    let cache = match settings.cache_ram_mib {
        Some(n) if n < 0 => {
            return Err(Error::invalid(format!(
                "--cache-ram {n} (no limit) cannot be held to --ram-budget; give the prompt cache a size in MiB (sdq's default under this budget is {} MiB)",
                reserve / 2 / MIB
            )))
        }
        Some(n) => n as u64 * MIB,
        None => {
            let mib = reserve / 2 / MIB;
            env.push(("LLAMA_ARG_CACHE_RAM", mib.to_string()));
            chosen.push(format!("--cache-ram {mib}"));
            mib * MIB
        }
    };
    // Drafting keeps one more copy of each slot's recurrent state.
    let speculative = if settings.speculative { slots * checkpoint } else { 0 };
    let checkpoints = match settings.checkpoints {
        Some(n) => n.max(0) as u64,
        None if checkpoint == 0 => 0,
        None => {
            // At least one: with none, llama-server splits a prompt
            // otherwise than with any (it stops short of the end to take a
            // checkpoint), and the answers part from stock's defaults.
            let n = ((reserve / 4).saturating_sub(speculative) / (slots * checkpoint)).clamp(1, MAX_CHECKPOINTS);
            env.push(("LLAMA_ARG_CTX_CHECKPOINTS", n.to_string()));
            let per = if slots == 1 { "slot" } else { "slots" };
            chosen.push(format!("--ctx-checkpoints {n} ({} each, {slots} {per})", human(checkpoint)));
            n
        }
    };
    let bytes = cache + slots * checkpoints * checkpoint + speculative;
    // Three quarters of the reserve are for these; the last quarter stays free.
    let needed = bytes + reserve / 4;
    let (reserve, raised) = if needed > reserve { (needed, true) } else { (reserve, false) };
    let mut notice = Vec::new();
    if !chosen.is_empty() {
        notice.push(format!("under the budget, {} (set them to override)", chosen.join(" and ")));
    }
    if raised {
        notice.push(format!(
            "the reserve is raised to {} to hold the prompt cache and checkpoints{} ({})",
            human(reserve),
            if speculative > 0 { " and the recurrent state drafting keeps" } else { "" },
            human(bytes)
        ));
    }
    Ok(GrowthPlan { reserve, env, bytes, notice: (!notice.is_empty()).then(|| notice.join("; ")) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(args: &[&str], env: &[(&str, &str)]) -> Result<ToolSettings> {
        let args: Vec<String> = std::iter::once("llama-server").chain(args.iter().copied()).map(String::from).collect();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ToolSettings::from_args_and_env(&args, &move |k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn reads_flags_like_upstream() {
        let s = settings(&["-cram", "64", "--parallel=2", "--ctx-checkpoints", "3", "--cache-ram", "100"], &[]).unwrap();
        assert_eq!(s, ToolSettings { cache_ram_mib: Some(100), checkpoints: Some(3), parallel: Some(2), speculative: false });
        let s = settings(&[], &[("LLAMA_ARG_CACHE_RAM", "12"), ("LLAMA_ARG_N_PARALLEL", "-1")]).unwrap();
        assert_eq!(s, ToolSettings { cache_ram_mib: Some(12), checkpoints: None, parallel: Some(-1), speculative: false });
        assert!(settings(&["-cram", "lots"], &[]).unwrap_err().to_string().contains("-cram: 'lots'"));
    }

    // The 35B-A3B's recurrent state: 30 layers of (3 × (4096 + 2·16·128)
    // + 128·4096) f32, 65.9 MB per checkpoint.
    const REAL_CKPT: u64 = 30 * (3 * (4096 + 2 * 16 * 128) + 128 * 4096) * 4;

    #[test]
    fn defaults_fit_in_the_reserve() {
        // 8 GiB: reserve 512 MiB, 4 slots of 65.9 MB fit no checkpoint in
        // 128 MiB; one each is kept, and the reserve grows to hold it.
        let p = plan(&ToolSettings::default(), 512 * MIB, REAL_CKPT).unwrap();
        assert_eq!(p.env, vec![("LLAMA_ARG_CACHE_RAM", "256".to_string()), ("LLAMA_ARG_CTX_CHECKPOINTS", "1".to_string())]);
        assert_eq!(p.bytes, 256 * MIB + 4 * REAL_CKPT);
        assert_eq!(p.reserve, p.bytes + 128 * MIB);
        assert!(p.notice.unwrap().contains("reserve is raised"));
        // 16 GiB, one slot: 1 GiB reserve, 256 MiB of checkpoints hold 4.
        let one = ToolSettings { parallel: Some(1), ..Default::default() };
        let p = plan(&one, 1024 * MIB, REAL_CKPT).unwrap();
        assert_eq!(p.env[1], ("LLAMA_ARG_CTX_CHECKPOINTS", "4".to_string()));
        assert!(p.bytes <= 3 * p.reserve / 4);
        // A model without recurrent layers leaves checkpoints alone.
        assert_eq!(plan(&ToolSettings::default(), 512 * MIB, 0).unwrap().env.len(), 1);
    }

    #[test]
    fn the_draft_model_is_read_as_llama_cpp_reads_it() {
        let args = |a: &[&str]| std::iter::once("llama-server").chain(a.iter().copied()).map(String::from).collect::<Vec<_>>();
        let none = |_: &str| None;
        let env = |k: &str| (k == "LLAMA_ARG_MODEL_DRAFT").then(|| "env.gguf".to_string());
        assert_eq!(draft_model(&args(&["-md", "a.gguf"]), &none).as_deref(), Some("a.gguf"));
        assert_eq!(draft_model(&args(&["--model-draft=b.gguf", "-m", "t.gguf"]), &none).as_deref(), Some("b.gguf"));
        assert_eq!(draft_model(&args(&["-md", "a.gguf", "--model-draft", "c.gguf"]), &none).as_deref(), Some("c.gguf"));
        assert_eq!(draft_model(&args(&["-m", "t.gguf"]), &env).as_deref(), Some("env.gguf"));
        assert_eq!(draft_model(&args(&["-md", "a.gguf"]), &env).as_deref(), Some("a.gguf"));
        assert_eq!(draft_model(&args(&["-m", "t.gguf", "-md"]), &none), None);
    }

    #[test]
    fn drafting_keeps_each_slots_recurrent_state_in_the_reserve() {
        for (args, env, on) in [
            (&["--spec-type", "ngram-simple"][..], &[][..], true),
            (&["--spec-type=draft-mtp"][..], &[][..], true),
            (&["-md", "draft.gguf"][..], &[][..], true),
            (&["--spec-type", "none"][..], &[][..], false),
            (&[][..], &[("LLAMA_ARG_SPEC_TYPE", "ngram-mod")][..], true),
            (&[][..], &[][..], false),
        ] {
            assert_eq!(settings(args, env).unwrap().speculative, on, "{args:?} {env:?}");
        }
        // 4 GiB, one slot: a 256 MiB reserve held the cache (128 MiB) and one
        // checkpoint; drafting's copy of the state takes the checkpoint's room.
        let one = |speculative| ToolSettings { parallel: Some(1), speculative, ..Default::default() };
        let without = plan(&one(false), 256 * MIB, REAL_CKPT).unwrap();
        assert_eq!(without.env[1], ("LLAMA_ARG_CTX_CHECKPOINTS", "1".to_string()));
        let with = plan(&one(true), 256 * MIB, REAL_CKPT).unwrap();
        assert_eq!(with.env[1], ("LLAMA_ARG_CTX_CHECKPOINTS", "1".to_string()));
        assert_eq!(with.bytes, 128 * MIB + 2 * REAL_CKPT);
        assert_eq!(with.reserve, with.bytes + 64 * MIB);
        // Four slots' states: the reserve grows, and says why.
        let four = plan(&ToolSettings { speculative: true, ..Default::default() }, 256 * MIB, REAL_CKPT).unwrap();
        assert_eq!(four.bytes, 128 * MIB + 8 * REAL_CKPT);
        assert!(four.reserve > 256 * MIB && four.notice.unwrap().contains("the recurrent state drafting keeps"));
    }

    #[test]
    fn user_settings_raise_the_reserve_or_are_refused() {
        let s = ToolSettings { cache_ram_mib: Some(2048), checkpoints: Some(2), parallel: Some(4), speculative: false };
        let p = plan(&s, 512 * MIB, REAL_CKPT).unwrap();
        assert!(p.env.is_empty());
        assert_eq!(p.bytes, 2048 * MIB + 8 * REAL_CKPT);
        assert_eq!(p.reserve, p.bytes + 128 * MIB);
        assert!(p.notice.unwrap().contains("reserve is raised"));
        let small = ToolSettings { cache_ram_mib: Some(16), checkpoints: Some(0), parallel: None, speculative: false };
        let p = plan(&small, 512 * MIB, REAL_CKPT).unwrap();
        assert_eq!((p.reserve, p.notice), (512 * MIB, None));
        let e = plan(&ToolSettings { cache_ram_mib: Some(-1), ..Default::default() }, 512 * MIB, 0).unwrap_err();
        assert!(e.to_string().contains("--cache-ram -1 (no limit)"), "{e}");
    }
}
