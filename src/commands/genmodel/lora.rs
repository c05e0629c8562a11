//! A LoRA adapter for a generated model: the file `--lora` loads beside it,
//! as llama.cpp's converter writes one (`general.type = adapter`,
//! `adapter.type = lora`, `adapter.lora.alpha`, tensors `NAME.lora_a` and
//! `NAME.lora_b` in F32). It adapts every full-attention layer's value
//! projection and every MoE layer's up experts (gate/up where they are
//! fused), so that under a budget the paged experts' matmuls carry a LoRA
//! term. Random weights: it changes the model's answers, nothing more.

use super::spec::{Fill, ModelSpec, PlannedTensor};
use crate::engine::ffi::ggml::GgmlType;
use crate::engine::model::gguf::{GgufBuilder, Value};
use crate::error::{Error, Result};

/// The adapter's rank unless given.
pub const DEFAULT_RANK: i64 = 8;

/// The tensors, in file order: for a weight of shape [n_in, n_out(, n_expert)],
/// An error unless `rank` is one an adapter is written with (1..=256).
pub fn check_rank(rank: i64) -> Result<()> {
    if (1..=256).contains(&rank) {
        Ok(())
    } else {
        Err(Error::flag("--lora-rank", format!("--lora-rank {rank} is outside 1..=256")))
    }
}

/// `lora_a` is [n_in, rank(, n_expert)] and `lora_b` [rank, n_out(, n_expert)].
pub fn plan(spec: &ModelSpec, rank: i64) -> Vec<PlannedTensor> {
    let f = spec.family();
    let e = spec.n_embd;
    let mut out = Vec::new();
    let mut pair = |name: String, n_in: i64, n_out: i64, experts: Option<i64>| {
        let (a, b) = match experts {
            Some(x) => (vec![n_in, rank, x], vec![rank, n_out, x]),
            None => (vec![n_in, rank], vec![rank, n_out]),
        };
        out.push(PlannedTensor { name: format!("{name}.lora_a"), ty: GgmlType::F32, ne: a, fill: Fill::Dense { std: 1.0 / (n_in as f32).sqrt() } });
        // As large as the weight's own output (alpha = rank: scale 1), so
        // that the adapter changes the answer.
        out.push(PlannedTensor { name: format!("{name}.lora_b"), ty: GgmlType::F32, ne: b, fill: Fill::Dense { std: 2.0 / (rank as f32).sqrt() } });
    };
    for il in 0..spec.n_layer {
        let blk = |n: &str| format!("blk.{il}.{n}");
        if !spec.is_recurrent(il) && f.mixer != super::Mixer::Latent {
            pair(blk("attn_v.weight"), e, spec.n_head_kv * spec.head_dim, None);
        }
        if spec.is_moe(il) {
            let (x, ff) = (spec.n_expert, spec.n_ff_exp);
            if spec.fused_gate_up {
                pair(blk("ffn_gate_up_exps.weight"), e, 2 * ff, Some(x));
            } else {
                pair(blk("ffn_up_exps.weight"), e, ff, Some(x));
            }
        }
    }
    out
}

/// The keys llama.cpp's adapter loader reads.
pub fn write_metadata(spec: &ModelSpec, rank: i64, b: &mut GgufBuilder) {
    b.set("general.architecture", &Value::Str(spec.arch.name().into()));
    b.set("general.type", &Value::Str("adapter".into()));
    b.set("general.name", &Value::Str("sdq generated LoRA adapter".into()));
    b.set("adapter.type", &Value::Str("lora".into()));
    b.set("adapter.lora.alpha", &Value::F32(rank as f32));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_match_their_weights_shapes() {
        let spec = ModelSpec::preset("tiny").unwrap();
        let base = spec.plan();
        let lora = plan(&spec, 4);
        assert!(!lora.is_empty() && lora.len() % 2 == 0);
        for p in lora.chunks(2) {
            let name = p[0].name.strip_suffix(".lora_a").unwrap();
            assert_eq!(p[1].name, format!("{name}.lora_b"));
            let w = base.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name} is not in the model"));
            // What llama.cpp's loader checks: a's rows are the weight's, b's
            // columns its outputs, and a's rank is b's.
            assert_eq!((p[0].ne[0], p[1].ne[1], p[0].ne[1]), (w.ne[0], w.ne[1], p[1].ne[0]), "{name}");
            assert_eq!(p[0].ne.get(2), w.ne.get(2), "{name}");
        }
        assert!(lora.iter().any(|t| t.name.contains("_exps")), "no expert LoRA");
    }
}
