//! What a generated model looks like: architecture, geometry, presets, and the
//! tensor plan (names, shapes, Q4_K_M-style types) derived from them.

use crate::error::{Error, Result};
use crate::ggml::GgmlType;

/// Architectures the generator writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3.5 MoE: hybrid linear-attention (SSM) / full-attention layers, shared expert.
    Qwen35Moe,
    /// Qwen3 MoE: full attention in every layer, no shared expert.
    Qwen3Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen35Moe => "qwen35moe",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    pub fn from_name(s: &str) -> Result<Arch> {
        match s {
            "qwen35moe" => Ok(Arch::Qwen35Moe),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            other => Err(Error::invalid(format!("unknown architecture '{other}' (known: qwen35moe, qwen3moe)"))),
        }
    }
}

/// The geometry of a generated model. Field names follow the GGUF keys.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub n_layer: u32,
    pub n_embd: i64,
    pub n_head: i64,
    pub n_head_kv: i64,
    pub head_dim: i64,
    pub n_expert: i64,
    pub n_expert_used: i64,
    /// Width of one routed expert's FFN.
    pub n_ff_exp: i64,
    /// Width of the shared expert's FFN (qwen35moe only; 0 for none).
    pub n_ff_shexp: i64,
    pub n_vocab: usize,
    /// Linear attention: key heads (`ssm.group_count`).
    pub ssm_k_heads: i64,
    /// Linear attention: value heads (`ssm.time_step_rank`).
    pub ssm_v_heads: i64,
    /// Linear attention: head dimension (`ssm.state_size`).
    pub ssm_head_dim: i64,
    pub conv_kernel: i64,
    /// Layer i is full attention iff (i + 1) % interval == 0 (qwen35moe).
    pub full_attention_interval: u32,
    /// Write gate and up experts as one `ffn_gate_up_exps` tensor.
    pub fused_gate_up: bool,
    pub context_length: u32,
    /// Type of every routed-expert tensor instead of the Q4_K_M rule.
    pub expert_type: Option<GgmlType>,
    /// How strongly the routers prefer some experts over others: 0 routes on
    /// noise alone (near-uniform use, the worst case for a cache), 2 (the
    /// default) gives trained-looking hot and cold experts.
    pub router_skew: f32,
    pub seed: u64,
}

/// Named geometries.
pub const PRESETS: &[&str] = &["tiny", "35b-a3b"];

impl ModelSpec {
    /// A named preset: `tiny` (tens of MB, for tests) or `35b-a3b` (the
    /// geometry of Qwen3.5-35B-A3B / MiniCPM-V-4.7-35B-A3B).
    pub fn preset(name: &str) -> Result<ModelSpec> {
        match name {
            "tiny" => Ok(ModelSpec {
                arch: Arch::Qwen35Moe,
                n_layer: 8,
                n_embd: 256,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                n_expert: 16,
                n_expert_used: 4,
                n_ff_exp: 256,
                n_ff_shexp: 256,
                n_vocab: 151_936,
                ssm_k_heads: 2,
                ssm_v_heads: 4,
                ssm_head_dim: 64,
                conv_kernel: 4,
                full_attention_interval: 4,
                fused_gate_up: false,
                context_length: 4096,
                expert_type: None,
                router_skew: 2.0,
                seed: 1,
            }),
            "35b-a3b" => Ok(ModelSpec {
                arch: Arch::Qwen35Moe,
                n_layer: 40,
                n_embd: 2048,
                n_head: 16,
                n_head_kv: 2,
                head_dim: 256,
                n_expert: 256,
                n_expert_used: 8,
                n_ff_exp: 512,
                n_ff_shexp: 512,
                n_vocab: 248_320,
                ssm_k_heads: 16,
                ssm_v_heads: 32,
                ssm_head_dim: 128,
                conv_kernel: 4,
                full_attention_interval: 4,
                fused_gate_up: false,
                context_length: 262_144,
                expert_type: None,
                router_skew: 2.0,
                seed: 1,
            }),
            other => Err(Error::invalid(format!("unknown preset '{other}' (known: {})", PRESETS.join(", ")))),
        }
    }

    /// Checks the constraints llama.cpp's loader and graph place on the geometry.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid(format!("invalid model geometry: {what}")));
        let positive = [
            ("layers", self.n_layer as i64),
            ("n_embd", self.n_embd),
            ("heads", self.n_head),
            ("kv heads", self.n_head_kv),
            ("head dim", self.head_dim),
            ("experts", self.n_expert),
            ("top-k", self.n_expert_used),
            ("expert FFN", self.n_ff_exp),
            ("vocab", self.n_vocab as i64),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return bad(format!("{name} must be positive, got {v}"));
            }
        }
        if self.n_layer > 512 {
            return bad(format!("{} layers is more than 512", self.n_layer));
        }
        if self.n_expert > 512 || self.n_expert_used > self.n_expert {
            return bad(format!("top-k {} of {} experts (at most 512 experts, top-k ≤ experts)", self.n_expert_used, self.n_expert));
        }
        if self.n_head % self.n_head_kv != 0 {
            return bad(format!("heads {} not a multiple of kv heads {}", self.n_head, self.n_head_kv));
        }
        for (name, v) in [("n_embd", self.n_embd), ("expert FFN", self.n_ff_exp), ("head dim", self.head_dim)] {
            if v % 32 != 0 {
                return bad(format!("{name} {v} is not a multiple of 32 (ggml's quantized block)"));
            }
        }
        if self.n_ff_shexp < 0 || self.n_ff_shexp % 32 != 0 {
            return bad(format!("shared expert FFN {} must be 0 or a positive multiple of 32", self.n_ff_shexp));
        }
        if self.arch == Arch::Qwen35Moe {
            if self.rope_sections().is_none() {
                return bad(format!("head dim {} too small for 4 rope sections", self.head_dim));
            }
            if self.ssm_k_heads <= 0 || self.ssm_v_heads % self.ssm_k_heads != 0 {
                return bad(format!("linear-attention value heads {} not a multiple of key heads {}", self.ssm_v_heads, self.ssm_k_heads));
            }
            if self.ssm_head_dim <= 0 || self.ssm_head_dim % 32 != 0 || self.conv_kernel <= 0 {
                return bad(format!("linear-attention head dim {} / conv kernel {}", self.ssm_head_dim, self.conv_kernel));
            }
            if self.full_attention_interval == 0 || self.full_attention_interval > self.n_layer {
                // llama.cpp cannot build a KV cache without any attention layer.
                return bad(format!(
                    "full attention every {} layers leaves {} layers without any attention layer (need an interval of 1..={})",
                    self.full_attention_interval, self.n_layer, self.n_layer
                ));
            }
            if self.n_ff_shexp == 0 {
                return bad("qwen35moe needs a shared expert (shared FFN > 0)".into());
            }
        } else {
            if self.n_ff_shexp != 0 {
                return bad("qwen3moe has no shared expert (use --shared-ff 0)".into());
            }
            if self.fused_gate_up {
                return bad("qwen3moe's loader does not accept fused gate/up experts".into());
            }
        }
        if !(self.router_skew.is_finite() && (0.0..=16.0).contains(&self.router_skew)) {
            return bad(format!("router skew {} is outside 0..=16", self.router_skew));
        }
        if let Some(t) = self.expert_type {
            if !t.can_quantize() {
                return bad(format!("ggml cannot quantize to {} without an importance matrix", t.name()));
            }
            for n in [self.n_embd, self.n_ff_exp] {
                if n % t.block_size() != 0 {
                    return bad(format!("expert rows of {n} are not a multiple of {}'s block of {}", t.name(), t.block_size()));
                }
            }
        }
        Ok(())
    }

    /// True if layer `il` is linear attention (qwen35moe's recurrent layers).
    pub fn is_recurrent(&self, il: u32) -> bool {
        self.arch == Arch::Qwen35Moe && (il + 1) % self.full_attention_interval != 0
    }

    /// Rotary dimensions: a quarter of the head, as in the real model.
    pub fn rope_dim(&self) -> i64 {
        if self.arch == Arch::Qwen35Moe {
            self.head_dim / 4
        } else {
            self.head_dim
        }
    }

    /// IMRoPE sections summing to rope_dim / 2 in the converter's 11:11:10 ratio.
    pub fn rope_sections(&self) -> Option<[i32; 4]> {
        let half = self.rope_dim() / 2;
        let s = (half * 11 + 16) / 32;
        let rest = half - 2 * s;
        (s > 0 && rest >= 0).then_some([s as i32, s as i32, rest as i32, 0])
    }

    /// Q4_K_M's `use_more_bits(i, n_layer)`: which down projections (and
    /// which attn_v, counted among attention layers) get Q6_K.
    pub fn use_more_bits(&self, il: u32) -> bool {
        let (i, n) = (il as i64, self.n_layer as i64);
        i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
    }

    /// Linear attention's conv channels: q, k (key heads) and v (value heads).
    pub fn ssm_conv_dim(&self) -> i64 {
        2 * self.ssm_k_heads * self.ssm_head_dim + self.ssm_v_heads * self.ssm_head_dim
    }

    pub fn ssm_value_dim(&self) -> i64 {
        self.ssm_v_heads * self.ssm_head_dim
    }
}

/// How a tensor's values are generated before quantization.
#[derive(Clone, Debug, PartialEq)]
pub enum Fill {
    /// Every element the same (norm weights).
    Const(f32),
    /// Uniform on [lo, hi).
    Uniform(f32, f32),
    /// Independent values of standard deviation `std`.
    Dense { std: f32 },
    /// Token embeddings: noise plus the shared direction u, so every hidden
    /// state carries a stable component for the routers to see.
    Embedding { std: f32, u_gain: f32 },
    /// A router: noise plus b_e·u with a per-layer permutation of normal
    /// quantiles b_e, which makes some experts far more popular than others.
    Router { std: f32, skew: f32, layer: u32 },
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub ty: GgmlType,
    pub ne: Vec<i64>,
    pub fill: Fill,
}

impl PlannedTensor {
    pub fn nbytes(&self) -> u64 {
        let rows: i64 = self.ne[1..].iter().product();
        self.ty.row_size(self.ne[0]) as u64 * rows as u64
    }
}

/// Q4_K_M's choice for a quantized weight with rows of `n`: the K-quant if the
/// row fits its 256-element blocks, else Q8_0 (32-element blocks).
fn kquant_or_fallback(k: GgmlType, n: i64) -> GgmlType {
    if n % 256 == 0 {
        k
    } else {
        GgmlType::Q8_0
    }
}

impl ModelSpec {
    /// Every tensor of the model, in file order, with its type and fill.
    pub fn plan(&self) -> Vec<PlannedTensor> {
        let e = self.n_embd;
        let mut out = Vec::new();
        let mut add = |name: String, ty: GgmlType, ne: Vec<i64>, fill: Fill| {
            let ty = if ty == GgmlType::F32 { ty } else { kquant_or_fallback(ty, ne[0]) };
            out.push(PlannedTensor { name, ty, ne, fill });
        };
        let dense = |fan_in: i64| Fill::Dense { std: 1.0 / (fan_in as f32).sqrt() };
        // Projections that write into the residual stream are scaled down so the
        // embedding's shared direction (what routers key on) survives depth.
        let residual = |fan_in: i64| Fill::Dense { std: 0.15 / (fan_in as f32).sqrt() };
        let v = self.n_vocab as i64;
        let (q4k, q5k, q6k, f32t) = (GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32);
        // llama-quant counts attn_v and attn_qkv tensors together (one per layer
        // here) but advances its index on attn_v only.
        let mut attn_v_index = 0u32;

        add("token_embd.weight".into(), q4k, vec![e, v], Fill::Embedding { std: 1.0, u_gain: 1.0 });
        for il in 0..self.n_layer {
            let blk = |n: &str| format!("blk.{il}.{n}");
            let more = if self.use_more_bits(il) { q6k } else { q4k };
            let mut attn_v_type = || {
                attn_v_index += 1;
                if self.use_more_bits(attn_v_index - 1) { q6k } else { q4k }
            };
            add(blk("attn_norm.weight"), f32t, vec![e], Fill::Const(1.0));
            let (hd, h, hkv) = (self.head_dim, self.n_head, self.n_head_kv);
            match self.arch {
                Arch::Qwen35Moe => {
                    add(blk("post_attention_norm.weight"), f32t, vec![e], Fill::Const(1.0));
                    if self.is_recurrent(il) {
                        let (conv, vd, r) = (self.ssm_conv_dim(), self.ssm_value_dim(), self.ssm_v_heads);
                        add(blk("attn_qkv.weight"), q5k, vec![e, conv], dense(e));
                        add(blk("attn_gate.weight"), q4k, vec![e, vd], dense(e));
                        add(blk("ssm_conv1d.weight"), f32t, vec![self.conv_kernel, conv], Fill::Dense { std: 0.5 });
                        add(blk("ssm_dt.bias"), f32t, vec![r], Fill::Uniform(-1.0, 1.0));
                        // ssm_a holds A = -exp(A_log); decays stay in (0, 1).
                        add(blk("ssm_a"), f32t, vec![r], Fill::Uniform(-8.0, -1.0));
                        add(blk("ssm_beta.weight"), q4k, vec![e, r], dense(e));
                        add(blk("ssm_alpha.weight"), q4k, vec![e, r], dense(e));
                        add(blk("ssm_norm.weight"), f32t, vec![self.ssm_head_dim], Fill::Const(1.0));
                        add(blk("ssm_out.weight"), q4k, vec![vd, e], residual(vd));
                    } else {
                        add(blk("attn_q.weight"), q4k, vec![e, 2 * h * hd], dense(e));
                        add(blk("attn_k.weight"), q4k, vec![e, hkv * hd], dense(e));
                        add(blk("attn_v.weight"), attn_v_type(), vec![e, hkv * hd], dense(e));
                        add(blk("attn_output.weight"), q4k, vec![h * hd, e], residual(h * hd));
                        add(blk("attn_q_norm.weight"), f32t, vec![hd], Fill::Const(1.0));
                        add(blk("attn_k_norm.weight"), f32t, vec![hd], Fill::Const(1.0));
                    }
                }
                Arch::Qwen3Moe => {
                    add(blk("attn_q.weight"), q4k, vec![e, h * hd], dense(e));
                    add(blk("attn_k.weight"), q4k, vec![e, hkv * hd], dense(e));
                    add(blk("attn_v.weight"), attn_v_type(), vec![e, hkv * hd], dense(e));
                    add(blk("attn_output.weight"), q4k, vec![h * hd, e], residual(h * hd));
                    add(blk("attn_q_norm.weight"), f32t, vec![hd], Fill::Const(1.0));
                    add(blk("attn_k_norm.weight"), f32t, vec![hd], Fill::Const(1.0));
                    add(blk("ffn_norm.weight"), f32t, vec![e], Fill::Const(1.0));
                }
            }
            let (x, f) = (self.n_expert, self.n_ff_exp);
            add(blk("ffn_gate_inp.weight"), f32t, vec![e, x], Fill::Router { std: 1.0 / (e as f32).sqrt(), skew: self.router_skew, layer: il });
            let gate_up_ty = self.expert_type.unwrap_or(q4k);
            let down_ty = self.expert_type.unwrap_or(more);
            if self.fused_gate_up {
                add(blk("ffn_gate_up_exps.weight"), gate_up_ty, vec![e, 2 * f, x], dense(e));
            } else {
                add(blk("ffn_gate_exps.weight"), gate_up_ty, vec![e, f, x], dense(e));
                add(blk("ffn_up_exps.weight"), gate_up_ty, vec![e, f, x], dense(e));
            }
            add(blk("ffn_down_exps.weight"), down_ty, vec![f, e, x], residual(f));
            if self.n_ff_shexp > 0 {
                let fs = self.n_ff_shexp;
                add(blk("ffn_gate_inp_shexp.weight"), f32t, vec![e], dense(e));
                add(blk("ffn_gate_shexp.weight"), q4k, vec![e, fs], dense(e));
                add(blk("ffn_up_shexp.weight"), q4k, vec![e, fs], dense(e));
                add(blk("ffn_down_shexp.weight"), more, vec![fs, e], residual(fs));
            }
        }
        add("output_norm.weight".into(), f32t, vec![e], Fill::Const(1.0));
        add("output.weight".into(), q6k, vec![e, v], dense(e));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_where(plan: &[PlannedTensor], pred: impl Fn(&str) -> bool) -> u64 {
        plan.iter().filter(|t| pred(&t.name)).map(|t| t.nbytes()).sum()
    }

    /// The target model's accounting, computed from its geometry in
    /// shared/notes/build-and-models.md (not from this generator).
    #[test]
    fn the_35b_a3b_plan_matches_the_target_accounting() {
        let spec = ModelSpec::preset("35b-a3b").unwrap();
        spec.validate().unwrap();
        let plan = spec.plan();
        assert_eq!(bytes_where(&plan, |n| n.ends_with("_exps.weight")), 19_503_513_600);
        assert_eq!(bytes_where(&plan, |n| n == "token_embd.weight" || n == "output.weight"), 703_242_240);
        assert_eq!(bytes_where(&plan, |n| n.ends_with("ffn_gate_inp.weight")), 83_886_080);
        assert_eq!(bytes_where(&plan, |n| n.contains("shexp")), 76_513_280);

        let q6k_down: Vec<u32> = (0..40)
            .filter(|il| {
                let name = format!("blk.{il}.ffn_down_exps.weight");
                plan.iter().find(|t| t.name == name).unwrap().ty == GgmlType::Q6_K
            })
            .collect();
        let expect: Vec<u32> = [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39].to_vec();
        assert_eq!(q6k_down, expect);
        // Two expert sizes: 2,039,808 B (Q6_K down) and 1,769,472 B (Q4_K down).
        let per_expert = |il: u32| bytes_where(&plan, |n| n.starts_with(&format!("blk.{il}.")) && n.ends_with("_exps.weight")) / 256;
        assert_eq!((per_expert(0), per_expert(5)), (2_039_808, 1_769_472));
        assert_eq!((0..40).filter(|&il| !spec.is_recurrent(il)).count(), 10);
    }

    #[test]
    fn tiny_is_small_and_valid() {
        let spec = ModelSpec::preset("tiny").unwrap();
        spec.validate().unwrap();
        let total: u64 = spec.plan().iter().map(|t| t.nbytes()).sum();
        assert!(total < 100 << 20, "tiny is {total} bytes");
    }
}
