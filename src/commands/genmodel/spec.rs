//! What a generated model looks like: architecture, geometry, presets, and the
//! tensor plan (names, shapes, Q4_K_M-style types) derived from them.
//!
//! Over 600 lines: the table of every family the generator writes (each
//! family's tensors, keys and presets), one entry per architecture, and
//! its tests; a new architecture is one more entry here.

use crate::engine::ffi::ggml::GgmlType;
use crate::error::{Error, Result};

/// Architectures the generator writes: one [`Family`] description each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3.5 MoE: hybrid linear-attention (SSM) / full-attention layers, shared expert.
    Qwen35Moe,
    /// Qwen3 MoE: full attention in every layer, no shared expert.
    Qwen3Moe,
    /// Qwen3-Next: Qwen3.5's hybrid layout with its own linear-attention tensors.
    Qwen3Next,
    /// gpt-oss: sliding-window attention with sinks, biased router and experts.
    GptOss,
    /// DeepSeek V2/V3: multi-head latent attention, leading dense layers,
    /// shared experts, sigmoid routing in expert groups with `exp_probs_b`.
    DeepSeek2,
    /// GLM-4.5: biased q/k/v, a dense first layer, shared expert, sigmoid
    /// routing with `exp_probs_b`, and a NextN (multi-token prediction) block.
    Glm4Moe,
    /// Gemma 4 MoE (26B-A4B): a dense MLP beside fused gate/up experts with a
    /// per-expert down scale, sliding-window layers.
    Gemma4,
    /// Mixtral: Llama with 8 experts, top-2.
    Llama,
}

/// How a family attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    /// Grouped-query attention in every layer.
    Attention,
    /// Linear attention (gated delta net) with full attention every
    /// `full_attention_interval` layers; the tensors are Qwen3.5's or Qwen3-Next's.
    Hybrid(Recurrent),
    /// DeepSeek's multi-head latent attention (split k_b/v_b, as converted today).
    Latent,
}

/// The two linear-attention tensor layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recurrent {
    /// `ssm_beta`, `ssm_alpha` (Qwen3.5).
    Qwen35,
    /// `ssm_ba` (Qwen3-Next).
    Qwen3Next,
}

/// What a family has besides the routed experts in an MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    None,
    /// One shared expert of `n_ff_shexp` behind a sigmoid gate (`ffn_gate_inp_shexp`).
    Gated,
    /// `expert_shared_count` shared experts of the routed width, fused into one.
    Counted,
    /// A dense MLP of `feed_forward_length` beside the experts (Gemma 4).
    DenseMlp,
}

/// How the router scores experts, as far as the file is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// Softmax over `ffn_gate_inp` logits.
    Softmax,
    /// Softmax with a router bias (`ffn_gate_inp.bias`, gpt-oss).
    SoftmaxBias,
    /// Sigmoid scores with a selection bias `exp_probs_b`, normalized and scaled
    /// (`expert_gating_func` 2); in groups where `expert_group_count` > 1.
    SigmoidBias,
    /// Softmax of the normed input scaled per channel (`ffn_gate_inp.scale`, Gemma 4).
    ScaledInput,
}

/// Where the family's FFN input norm sits and which extra norms it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norms {
    /// `ffn_norm` before the FFN.
    FfnNorm,
    /// `post_attention_norm` before the FFN.
    PostAttention,
    /// Gemma 4's sandwich: post-attention, pre/post FFN and per-branch norms.
    Gemma,
}

/// One architecture family: everything the generator writes differently for
/// it. The plan and the metadata are derived from these fields alone.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub arch: Arch,
    /// `general.architecture`.
    pub name: &'static str,
    /// Real models of the family, for the docs.
    pub models: &'static str,
    pub mixer: Mixer,
    /// The query projection is twice as wide: a gate for the attention output.
    pub gated_query: bool,
    pub qk_norm: bool,
    pub qkv_bias: bool,
    pub out_bias: bool,
    /// Per-head attention sinks.
    pub sinks: bool,
    /// Sliding-window attention layers (with the window in the metadata).
    pub sliding_window: bool,
    pub norms: Norms,
    pub router: Router,
    pub shared: Shared,
    /// Per-expert biases on gate, up and down.
    pub expert_bias: bool,
    /// A per-expert scale on the down projection.
    pub down_scale: bool,
    /// Gate and up experts are written fused by default.
    pub fused_by_default: bool,
    /// The loader accepts fused gate/up experts.
    pub fused_allowed: bool,
    /// Leading layers with a dense FFN instead of experts.
    pub dense_lead: u32,
    /// NextN (multi-token prediction) blocks after the last layer.
    pub nextn: u32,
    /// Rotary dimensions as a fraction of the head: 1/`rope_divisor`.
    pub rope_divisor: i64,
    pub rope_freq_base: f32,
    /// RoPE rotates pairs (j, j + dims/2) (NeoX and its multi-section kin)
    /// rather than (j, j + 1).
    pub rope_neox: bool,
    /// `sdq gen-model --routing trained`: the router skew, context gain,
    /// recency and carry whose replayed LRU and Bélády curves come closest
    /// to the shared trained trace's, measured on the family at the tiny
    /// geometry with 16 layers and 128 experts top-6, on the mean of three
    /// seeds' curves (`scripts/calibrate-routing.py --seeds 5,6,7`;
    /// docs/BENCHMARKS.md, "Routing that looks trained"). Families not
    /// measured keep (1, 1, 0, 0).
    pub trained_routing: (f32, f32, f32, f32),
    /// Experts and top-k the family always has (Mixtral's 8, top-2); None keeps the preset's.
    pub experts: Option<(i64, i64)>,
}

const BASE: Family = Family {
    arch: Arch::Qwen3Moe,
    name: "qwen3moe",
    models: "",
    mixer: Mixer::Attention,
    gated_query: false,
    qk_norm: false,
    qkv_bias: false,
    out_bias: false,
    sinks: false,
    sliding_window: false,
    norms: Norms::FfnNorm,
    router: Router::Softmax,
    shared: Shared::None,
    expert_bias: false,
    down_scale: false,
    fused_by_default: false,
    fused_allowed: true,
    dense_lead: 0,
    nextn: 0,
    rope_divisor: 1,
    rope_freq_base: 1_000_000.0,
    rope_neox: true,
    trained_routing: (1.0, 1.0, 0.0, 0.0),
    experts: None,
};

/// Every family the generator writes, in the order the docs list them.
pub const FAMILIES: &[Family] = &[
    Family {
        arch: Arch::Qwen35Moe,
        name: "qwen35moe",
        models: "Qwen3.5-35B-A3B, MiniCPM-V-4.7-35B-A3B",
        mixer: Mixer::Hybrid(Recurrent::Qwen35),
        gated_query: true,
        qk_norm: true,
        norms: Norms::PostAttention,
        shared: Shared::Gated,
        rope_divisor: 4,
        rope_freq_base: 10_000_000.0,
        trained_routing: (0.25, 1.5, 0.0, 16.0),
        ..BASE
    },
    Family { arch: Arch::Qwen3Moe, name: "qwen3moe", models: "Qwen3-30B-A3B, Qwen3-235B-A22B", qk_norm: true, fused_allowed: false, ..BASE },
    Family {
        arch: Arch::Qwen3Next,
        name: "qwen3next",
        models: "Qwen3-Next-80B-A3B",
        mixer: Mixer::Hybrid(Recurrent::Qwen3Next),
        gated_query: true,
        qk_norm: true,
        norms: Norms::PostAttention,
        shared: Shared::Gated,
        rope_divisor: 4,
        ..BASE
    },
    Family {
        arch: Arch::GptOss,
        name: "gpt-oss",
        models: "gpt-oss-20b, gpt-oss-120b",
        qkv_bias: true,
        out_bias: true,
        sinks: true,
        sliding_window: true,
        norms: Norms::PostAttention,
        router: Router::SoftmaxBias,
        expert_bias: true,
        fused_allowed: false,
        rope_freq_base: 150_000.0,
        trained_routing: (0.0, 1.0, 11.0, 2.0),
        ..BASE
    },
    Family {
        arch: Arch::DeepSeek2,
        name: "deepseek2",
        models: "DeepSeek-V3, DeepSeek-R1, Kimi-K2",
        mixer: Mixer::Latent,
        router: Router::SigmoidBias,
        shared: Shared::Counted,
        dense_lead: 1,
        rope_freq_base: 10_000.0,
        rope_neox: false,
        trained_routing: (0.1, 0.65, 10.0, 0.0),
        ..BASE
    },
    Family {
        arch: Arch::Glm4Moe,
        name: "glm4moe",
        models: "GLM-4.5, GLM-4.5-Air, GLM-4.6",
        qkv_bias: true,
        norms: Norms::PostAttention,
        router: Router::SigmoidBias,
        shared: Shared::Counted,
        fused_allowed: false,
        dense_lead: 1,
        nextn: 1,
        rope_divisor: 2,
        ..BASE
    },
    Family {
        arch: Arch::Gemma4,
        name: "gemma4",
        models: "Gemma-4-26B-A4B",
        qk_norm: true,
        sliding_window: true,
        norms: Norms::Gemma,
        router: Router::ScaledInput,
        shared: Shared::DenseMlp,
        down_scale: true,
        fused_by_default: true,
        rope_freq_base: 1_000_000.0,
        ..BASE
    },
    Family { arch: Arch::Llama, name: "llama", models: "Mixtral-8x7B, Mixtral-8x22B", fused_allowed: false, rope_neox: false, experts: Some((8, 2)), ..BASE },
];

impl Arch {
    /// This architecture's description.
    pub fn family(self) -> &'static Family {
        FAMILIES.iter().find(|f| f.arch == self).expect("every Arch has a family")
    }

    pub fn name(self) -> &'static str {
        self.family().name
    }

    pub fn from_name(s: &str) -> Result<Arch> {
        FAMILIES.iter().find(|f| f.name == s).map(|f| f.arch).ok_or_else(|| {
            let known: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
            Error::flag("--arch", format!("unknown architecture '{s}' (known: {})", known.join(", ")))
        })
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
    /// Width of the shared expert's FFN (`Shared::Gated`; 0 for none).
    pub n_ff_shexp: i64,
    /// Width of a dense FFN: leading dense layers, Gemma 4's MLP.
    pub n_ff_dense: i64,
    /// Shared experts of the routed width (`Shared::Counted`).
    pub n_expert_shared: i64,
    /// Leading layers with a dense FFN.
    pub n_layer_dense_lead: u32,
    /// Expert groups for grouped routing (1: none) and groups used per token.
    pub expert_groups: i64,
    pub expert_groups_used: i64,
    /// NextN blocks after the last layer (skipped by llama.cpp unless MTP drafting).
    pub n_nextn: u32,
    /// Latent attention: query and key-value compression ranks.
    pub q_lora_rank: i64,
    pub kv_lora_rank: i64,
    /// Sliding-window attention's window (families with `sliding_window`).
    pub sliding_window: u32,
    pub n_vocab: usize,
    /// Linear attention: key heads (`ssm.group_count`).
    pub ssm_k_heads: i64,
    /// Linear attention: value heads (`ssm.time_step_rank`).
    pub ssm_v_heads: i64,
    /// Linear attention: head dimension (`ssm.state_size`).
    pub ssm_head_dim: i64,
    pub conv_kernel: i64,
    /// Layer i is full attention iff (i + 1) % interval == 0 (hybrid families).
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
    /// The scale of the projections that write a mixer's output (attention,
    /// linear attention) into the residual stream, relative to 1/sqrt(fan-in):
    /// the larger, the more of the earlier tokens each hidden state, and so
    /// each routing decision, carries.
    pub context_gain: f32,
    /// How strongly attention favours the previous token (0: not at all, as
    /// random weights do). Above 0, every attention layer's queries and keys
    /// carry a constant on their fastest-turning rotary pairs, so that RoPE
    /// alone makes a previous-token head. On gpt-oss and deepseek2 that is
    /// what breaks greedy decoding's loops of a few tokens, whose experts
    /// any cache of two token cycles holds (docs/BENCHMARKS.md).
    pub recency: f32,
    /// How much of the previous tokens' routing input each attention layer
    /// carries into the current token's (0: none, the default). Above 0, the
    /// routers read only a subspace of `head_dim` coordinates, the first KV
    /// head's values copy it, the output projection writes them back scaled
    /// by `carry`, and the output head ignores it. So neighbouring tokens
    /// share part of their routing input, and so some of their experts, as
    /// a trained model's do, without steering the next token.
    pub carry: f32,
    /// A preset's own `--routing trained` setting, where it was calibrated
    /// at its full geometry (None: the family's, from the tiny geometry).
    /// Routing reuse grows with depth and width, so a full-size model's can
    /// land far from the tiny one's on the same setting.
    pub preset_trained_routing: Option<(f32, f32, f32, f32)>,
    pub seed: u64,
}

/// Rotary pairs that carry the recency constant: the fastest-turning ones,
/// of at least this angle a token, whose cosines fall off within a few tokens.
pub const RECENCY_MIN_ANGLE: f32 = 0.2;

/// RoPE's base on sliding-window layers (`rope.freq_base_swa`).
pub const SWA_ROPE_FREQ_BASE: f32 = 10_000.0;

/// The scale of the latent direction that DeepSeek's query compression
/// carries, so that its expanded queries can carry the recency constant.
pub const LATENT_CARRIER_GAIN: f32 = 2.0;

/// Where a query or key projection's rotary rows sit: every `period` rows,
/// `dims` rotated rows start at `offset`; `neox` pairs row j with j + dims/2,
/// otherwise with j + 1; pair i turns base^(-2i/dims) radians a token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RotaryRows {
    pub period: i64,
    pub offset: i64,
    pub dims: i64,
    pub neox: bool,
    pub base: f32,
}

impl RotaryRows {
    /// If `row` belongs to one of the fast pairs: that pair's angle a token,
    /// and whether the row is the pair's first.
    pub fn fast_pair(&self, row: i64) -> Option<(f32, bool)> {
        let d = row % self.period;
        if d < self.offset || d >= self.offset + self.dims {
            return None;
        }
        let (j, half) = (d - self.offset, self.dims / 2);
        let (pair, first) = if self.neox { (j % half, j < half) } else { (j / 2, j % 2 == 0) };
        let angle = self.base.powf(-2.0 * pair as f32 / self.dims as f32);
        (angle >= RECENCY_MIN_ANGLE).then_some((angle, first))
    }
}

/// The direction a recency projection reads its constant from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Carrier {
    /// The embeddings' shared direction u (the residual stream).
    Shared,
    /// DeepSeek's latent direction, which the query compression writes.
    Latent,
}

/// The scale of projections into the residual stream, relative to
/// 1/sqrt(fan-in), small so that the embedding's shared direction (what
/// routers key on) survives depth.
pub const RESIDUAL_GAIN: f32 = 0.15;

/// Named geometries.
pub const PRESETS: &[&str] = &["tiny", "35b-a3b", "gpt-oss-120b", "gpt-oss-20b", "deepseek-v3"];

impl ModelSpec {
    /// A named preset: `tiny` (tens of MB, for tests), `35b-a3b` (the
    /// geometry of Qwen3.5-35B-A3B / MiniCPM-V-4.7-35B-A3B), or the real
    /// geometries of models people run far past RAM: `gpt-oss-120b` and
    /// `gpt-oss-20b` (MXFP4 experts, as OpenAI ships them) and `deepseek-v3`
    /// (also DeepSeek-R1's and V3.1's geometry). The figures are the models'
    /// published configurations (`config.json` of openai/gpt-oss-120b,
    /// openai/gpt-oss-20b and deepseek-ai/DeepSeek-V3).
    pub fn preset(name: &str) -> Result<ModelSpec> {
        let tiny = ModelSpec {
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
            n_ff_dense: 512,
            n_expert_shared: 1,
            n_layer_dense_lead: 0,
            expert_groups: 1,
            expert_groups_used: 1,
            n_nextn: 0,
            q_lora_rank: 128,
            kv_lora_rank: 128,
            sliding_window: 64,
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
            context_gain: RESIDUAL_GAIN,
            recency: 0.0,
            carry: 0.0,
            preset_trained_routing: None,
            seed: 1,
        };
        match name {
            "tiny" => Ok(tiny),
            "35b-a3b" => Ok(ModelSpec {
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
                context_length: 262_144,
                // Calibrated at full size (scripts/calibrate-routing.py --preset
                // 35b-a3b): the family's tiny setting reused far more there.
                preset_trained_routing: Some((0.5, 1.0, 0.0, 9.0)),
                ..tiny
            }),
            "gpt-oss-120b" | "gpt-oss-20b" => {
                let mut s = tiny;
                s.set_arch(Arch::GptOss);
                let (layers, experts) = if name == "gpt-oss-120b" { (36, 128) } else { (24, 32) };
                Ok(ModelSpec {
                    n_layer: layers,
                    n_embd: 2880,
                    n_head: 64,
                    n_head_kv: 8,
                    head_dim: 64,
                    n_expert: experts,
                    n_expert_used: 4,
                    n_ff_exp: 2880,
                    // o200k_harmony's 201,088 tokens (the rest of the tokenizer's padding).
                    n_vocab: 201_088,
                    sliding_window: 128,
                    context_length: 131_072,
                    expert_type: Some(GgmlType::MXFP4),
                    // Calibrated at full depth (scripts/calibrate-routing.py
                    // --preset gpt-oss-120b, seeds 5 and 6: 4.4 points from
                    // the trained trace): the family's tiny setting reused
                    // far more there.
                    preset_trained_routing: (name == "gpt-oss-120b").then_some((0.1, 0.5, 8.0, 1.0)),
                    ..s
                })
            }
            "deepseek-v3" => {
                let mut s = tiny;
                s.set_arch(Arch::DeepSeek2);
                Ok(ModelSpec {
                    n_layer: 61,
                    n_embd: 7168,
                    n_head: 128,
                    // qk_nope 128 + qk_rope 64; values of 128.
                    head_dim: 192,
                    n_expert: 256,
                    n_expert_used: 8,
                    n_ff_exp: 2048,
                    n_ff_dense: 18_432,
                    n_expert_shared: 1,
                    n_layer_dense_lead: 3,
                    expert_groups: 8,
                    expert_groups_used: 4,
                    q_lora_rank: 1536,
                    kv_lora_rank: 512,
                    n_vocab: 129_280,
                    context_length: 163_840,
                    // Calibrated on 19 layers at full width (scripts/calibrate-routing.py
                    // --preset deepseek-v3 --layers 19 --expert-type q2_K).
                    preset_trained_routing: Some((1.0, 0.5, 8.0, 0.0)),
                    ..s
                })
            }
            other => Err(Error::flag("--preset", format!("unknown preset '{other}' (known: {})", PRESETS.join(", ")))),
        }
    }

    /// True for the presets that are one real model's geometry (their
    /// architecture is part of them), false for the starting points
    /// `tiny` and `35b-a3b` that `--arch` turns into any family.
    pub fn preset_is_a_model(name: &str) -> bool {
        matches!(name, "gpt-oss-120b" | "gpt-oss-20b" | "deepseek-v3")
    }

    /// The (router skew, context gain, recency, carry) of `--routing
    /// trained`: the preset's own, else the family's.
    pub fn trained_routing(&self) -> (f32, f32, f32, f32) {
        self.preset_trained_routing.unwrap_or(self.family().trained_routing)
    }

    pub fn family(&self) -> &'static Family {
        self.arch.family()
    }

    /// Turns this geometry into `arch`'s: its default experts and top-k, its
    /// shared expert, dense leading layers, NextN blocks, fused experts and
    /// head layout (latent attention's heads are wider). Explicit options are
    /// applied after this.
    pub fn set_arch(&mut self, arch: Arch) {
        let f = arch.family();
        self.arch = arch;
        if let Some((n, k)) = f.experts {
            (self.n_expert, self.n_expert_used) = (n, k);
        }
        if f.shared != Shared::Gated {
            self.n_ff_shexp = 0;
        }
        self.n_layer_dense_lead = f.dense_lead;
        self.n_nextn = f.nextn;
        self.fused_gate_up = f.fused_by_default;
        self.full_attention_interval = self.full_attention_interval.min(self.n_layer);
        if f.mixer == Mixer::Latent {
            // DeepSeek-V3's query-key head (nope + rope) with values of the
            // nope width, scaled down; one latent KV head, as converted files have.
            self.head_dim = 96;
            self.n_head_kv = 1;
        }
        if arch == Arch::Llama {
            self.head_dim = self.n_embd / self.n_head;
            self.n_head_kv = self.n_head_kv.min(self.n_head);
        }
        // DeepSeek-V3 routes within 8 groups of which 4 are used; here 4 and 2.
        if arch == Arch::DeepSeek2 {
            self.expert_groups = 4;
            self.expert_groups_used = 2;
        } else {
            self.expert_groups = 1;
            self.expert_groups_used = 1;
        }
    }

    /// Layers in the file: the trunk plus NextN blocks.
    pub fn n_block(&self) -> u32 {
        self.n_layer + self.n_nextn
    }

    /// True if layer `il` has routed experts (not a leading dense layer).
    pub fn is_moe(&self, il: u32) -> bool {
        il >= self.n_layer_dense_lead
    }

    /// Checks the constraints llama.cpp's loader and graph place on the geometry.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid(format!("invalid model geometry: {what}")));
        let f = self.family();
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
        // llama.cpp builds a drafting graph from one NextN block (qwen35moe's
        // MTP) or loads one (glm4moe); other families would ignore it.
        if self.n_nextn > 1 || (self.n_nextn == 1 && !matches!(self.arch, Arch::Qwen35Moe | Arch::Glm4Moe)) {
            return bad(format!("{} NextN blocks on {}: llama.cpp reads at most one, on qwen35moe or glm4moe only", self.n_nextn, f.name));
        }
        for (name, v) in positive {
            if v <= 0 {
                return bad(format!("{name} must be positive, got {v}"));
            }
        }
        if self.n_block() > 512 {
            return bad(format!("{} layers is more than 512", self.n_block()));
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
        match (f.shared, self.n_ff_shexp) {
            (Shared::Gated, 0) => return bad(format!("{} needs a shared expert (shared FFN > 0)", f.name)),
            (Shared::Gated, _) | (_, 0) => {}
            _ => return bad(format!("{} has no gated shared expert of its own width (use --shared-ff 0)", f.name)),
        }
        if self.fused_gate_up && !f.fused_allowed {
            return bad(format!("{}'s loader does not accept fused gate/up experts", f.name));
        }
        // As many dense layers as layers: a dense model (a draft model, say).
        if self.n_layer_dense_lead > self.n_layer {
            return bad(format!("{} leading dense layers are more than the {} layers", self.n_layer_dense_lead, self.n_layer));
        }
        if self.n_ff_dense <= 0 || self.n_ff_dense % 32 != 0 {
            return bad(format!("dense FFN {} must be a positive multiple of 32", self.n_ff_dense));
        }
        if self.expert_groups > 1
            && (self.n_expert % self.expert_groups != 0
                || self.expert_groups_used >= self.expert_groups
                || self.expert_groups_used * (self.n_expert / self.expert_groups) < self.n_expert_used)
        {
            return bad(format!(
                "{} expert groups with {} used cannot pick top-{} of {} experts",
                self.expert_groups, self.expert_groups_used, self.n_expert_used, self.n_expert
            ));
        }
        if let Mixer::Hybrid(_) = f.mixer {
            if f.arch == Arch::Qwen35Moe && self.rope_sections().is_none() {
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
        }
        if f.mixer == Mixer::Latent {
            let (nope, v) = (self.head_dim - self.rope_dim(), self.mla_value_dim());
            if nope <= 0 || nope % 32 != 0 || v % 32 != 0 || self.q_lora_rank % 32 != 0 || self.kv_lora_rank % 32 != 0 {
                return bad(format!(
                    "latent attention head {} (rope {}, value {v}) and ranks {}/{} must give multiples of 32",
                    self.head_dim,
                    self.rope_dim(),
                    self.q_lora_rank,
                    self.kv_lora_rank
                ));
            }
        }
        if f.arch == Arch::Llama && self.head_dim * self.n_head != self.n_embd {
            return bad(format!("llama's head dim must be n_embd / heads = {}", self.n_embd / self.n_head));
        }
        if !(self.router_skew.is_finite() && (0.0..=16.0).contains(&self.router_skew)) {
            return bad(format!("router skew {} is outside 0..=16", self.router_skew));
        }
        if !(self.context_gain.is_finite() && (0.0..=4.0).contains(&self.context_gain)) {
            return bad(format!("context gain {} is outside 0..=4", self.context_gain));
        }
        if !(self.recency.is_finite() && (0.0..=16.0).contains(&self.recency)) {
            return bad(format!("recency {} is outside 0..=16", self.recency));
        }
        if !(self.carry.is_finite() && (0.0..=16.0).contains(&self.carry)) {
            return bad(format!("carry {} is outside 0..=16", self.carry));
        }
        if self.carry > 0.0 && self.family().mixer == Mixer::Latent {
            return bad(format!(
                "carry {} needs attention with its own value projection, which {}'s latent attention has not (use --recency)",
                self.carry,
                self.arch.name()
            ));
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

    /// True if layer `il` is linear attention (the hybrid families' recurrent layers).
    pub fn is_recurrent(&self, il: u32) -> bool {
        matches!(self.family().mixer, Mixer::Hybrid(_)) && il < self.n_layer && (il + 1) % self.full_attention_interval != 0
    }

    /// True if layer `il` uses sliding-window attention: gpt-oss alternates
    /// from the first layer; Gemma 4 has one full layer in every 4 here.
    pub fn is_swa(&self, il: u32) -> bool {
        match self.arch {
            Arch::GptOss => il % 2 == 0,
            Arch::Gemma4 => (il + 1) % 4 != 0,
            _ => false,
        }
    }

    /// Rotary dimensions: the family's fraction of the head (latent attention: a third).
    pub fn rope_dim(&self) -> i64 {
        if self.family().mixer == Mixer::Latent {
            self.head_dim / 3
        } else {
            self.head_dim / self.family().rope_divisor
        }
    }

    /// Latent attention's value head: the non-rotary part of the key head.
    pub fn mla_value_dim(&self) -> i64 {
        self.head_dim - self.rope_dim()
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
    /// With `dims` below the row length, the noise reads only the first
    /// `dims` columns (scaled to the same logit spread): the routing subspace
    /// that attention carries forward under `carry`.
    Router { std: f32, skew: f32, layer: u32, dims: i64 },
    /// Noise, with the first `skip` columns zero: the output head under
    /// `carry`, blind to the routing subspace so that what attention carries
    /// there moves routing and not the next token.
    DenseAfter { std: f32, skip: i64 },
    /// Noise plus `gain` at column r of row r for the first `dims` rows: a
    /// projection that copies its input's first `dims` coordinates (a value
    /// projection reading the routing subspace, or an output projection
    /// writing head 0's values back into it).
    Copy { std: f32, gain: f32, dims: i64 },
    /// A query or key projection: noise, plus on the fastest rotary rows
    /// `gain` times the carrier's direction, so those outputs are about the
    /// same constant at every token. A key's pair holds (1, 0), a query's
    /// the same turned back by one token's angle, so RoPE makes their score
    /// peak at the previous token and fall off with distance: a
    /// previous-token head.
    Recency { std: f32, gain: f32, rows: RotaryRows, carrier: Carrier, query: bool },
    /// DeepSeek's query compression: noise plus, in row j, `gain`·a_j·u, so
    /// that its output carries the latent direction a at every token.
    LatentCarrier { std: f32, gain: f32 },
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

/// The type a quantized weight with rows of `n` gets: `ty` if the row fits
/// its blocks (a K-quant's 256 elements, MXFP4's or Q8_0's 32), else Q8_0, as
/// Q4_K_M falls back where a K-quant does not fit. An explicit expert type
/// whose blocks do not fit is refused by `validate`, never replaced.
fn kquant_or_fallback(ty: GgmlType, n: i64) -> GgmlType {
    if n % ty.block_size() == 0 {
        ty
    } else {
        GgmlType::Q8_0
    }
}

impl ModelSpec {
    /// Every tensor of the model, in file order, with its type and fill.
    pub fn plan(&self) -> Vec<PlannedTensor> {
        let f = self.family();
        let e = self.n_embd;
        let mut out = Vec::new();
        let mut add = |name: String, ty: GgmlType, ne: Vec<i64>, fill: Fill| {
            let ty = if ty == GgmlType::F32 { ty } else { kquant_or_fallback(ty, ne[0]) };
            out.push(PlannedTensor { name, ty, ne, fill });
        };
        let dense = |fan_in: i64| Fill::Dense { std: 1.0 / (fan_in as f32).sqrt() };
        // Projections that write into the residual stream are scaled down so the
        // embedding's shared direction (what routers key on) survives depth.
        let residual = |fan_in: i64| Fill::Dense { std: RESIDUAL_GAIN / (fan_in as f32).sqrt() };
        let mixer_out = |fan_in: i64| Fill::Dense { std: self.context_gain / (fan_in as f32).sqrt() };
        // Queries and keys: with recency on, their fastest rotary rows carry a constant.
        let neox = f.rope_neox;
        let query_key = |fan_in: i64, rows: RotaryRows, carrier: Carrier, query: bool| {
            if self.recency > 0.0 {
                Fill::Recency { std: 1.0 / (fan_in as f32).sqrt(), gain: self.recency, rows, carrier, query }
            } else {
                dense(fan_in)
            }
        };
        // Under carry, the routing subspace: the first head_dim coordinates.
        let route_dims = if self.carry > 0.0 { self.head_dim.min(e) } else { e };
        let mut carried = false;
        let bias = Fill::Dense { std: 0.02 };
        let one = Fill::Const(1.0);
        let v = self.n_vocab as i64;
        let (q4k, q5k, q6k, f32t) = (GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32);
        // llama-quant counts attn_v and attn_qkv tensors together (one per layer
        // here) but advances its index on attn_v only.
        let mut attn_v_index = 0u32;

        add("token_embd.weight".into(), q4k, vec![e, v], Fill::Embedding { std: 1.0, u_gain: 1.0 });
        if f.norms == Norms::Gemma {
            // Proportional rope of the full-attention layers: one shared tensor.
            add("rope_freqs.weight".into(), f32t, vec![self.head_dim / 2], one.clone());
        }
        for il in 0..self.n_block() {
            let blk = |n: &str| format!("blk.{il}.{n}");
            let more = if self.use_more_bits(il) { q6k } else { q4k };
            let mut attn_v_type = || {
                attn_v_index += 1;
                if self.use_more_bits(attn_v_index - 1) {
                    q6k
                } else {
                    q4k
                }
            };
            add(blk("attn_norm.weight"), f32t, vec![e], one.clone());
            let (hd, h, hkv) = (self.head_dim, self.n_head, self.n_head_kv);
            let base = if self.is_swa(il) { SWA_ROPE_FREQ_BASE } else { f.rope_freq_base };
            let rotary = |period: i64, offset: i64| RotaryRows { period, offset, dims: self.rope_dim(), neox, base };
            if self.is_recurrent(il) {
                let (conv, vd, r) = (self.ssm_conv_dim(), self.ssm_value_dim(), self.ssm_v_heads);
                add(blk("attn_qkv.weight"), q5k, vec![e, conv], dense(e));
                add(blk("attn_gate.weight"), q4k, vec![e, vd], dense(e));
                add(blk("ssm_conv1d.weight"), f32t, vec![self.conv_kernel, conv], Fill::Dense { std: 0.5 });
                add(blk("ssm_dt.bias"), f32t, vec![r], Fill::Uniform(-1.0, 1.0));
                // ssm_a holds A = -exp(A_log); decays stay in (0, 1).
                add(blk("ssm_a"), f32t, vec![r], Fill::Uniform(-8.0, -1.0));
                if f.mixer == Mixer::Hybrid(Recurrent::Qwen3Next) {
                    add(blk("ssm_ba.weight"), q4k, vec![e, 2 * r], dense(e));
                } else {
                    add(blk("ssm_beta.weight"), q4k, vec![e, r], dense(e));
                    add(blk("ssm_alpha.weight"), q4k, vec![e, r], dense(e));
                }
                add(blk("ssm_norm.weight"), f32t, vec![self.ssm_head_dim], one.clone());
                add(blk("ssm_out.weight"), q4k, vec![vd, e], mixer_out(vd));
            } else if f.mixer == Mixer::Latent {
                let (rope, vdim, ql, kvl) = (self.rope_dim(), self.mla_value_dim(), self.q_lora_rank, self.kv_lora_rank);
                let nope = hd - rope;
                add(blk("attn_q_a_norm.weight"), f32t, vec![ql], one.clone());
                add(blk("attn_kv_a_norm.weight"), f32t, vec![kvl], one.clone());
                let q_a = if self.recency > 0.0 { Fill::LatentCarrier { std: 1.0 / (e as f32).sqrt(), gain: LATENT_CARRIER_GAIN } } else { dense(e) };
                add(blk("attn_q_a.weight"), q4k, vec![e, ql], q_a);
                add(blk("attn_q_b.weight"), q4k, vec![ql, h * hd], query_key(ql, rotary(hd, nope), Carrier::Latent, true));
                add(blk("attn_kv_a_mqa.weight"), q4k, vec![e, kvl + rope], query_key(e, rotary(kvl + rope, kvl), Carrier::Shared, false));
                add(blk("attn_k_b.weight"), GgmlType::Q8_0, vec![nope, kvl, h], dense(nope));
                add(blk("attn_v_b.weight"), attn_v_type(), vec![kvl, vdim, h], dense(kvl));
                add(blk("attn_output.weight"), q4k, vec![h * vdim, e], mixer_out(h * vdim));
            } else {
                let q_width = if f.gated_query { 2 * h * hd } else { h * hd };
                // A gated query is [query, gate] per head.
                let q_period = if f.gated_query { 2 * hd } else { hd };
                add(blk("attn_q.weight"), q4k, vec![e, q_width], query_key(e, rotary(q_period, 0), Carrier::Shared, true));
                add(blk("attn_k.weight"), q4k, vec![e, hkv * hd], query_key(e, rotary(hd, 0), Carrier::Shared, false));
                // Only the first attention layer copies: later copies would
                // carry what earlier ones carried, a sum over ever older tokens.
                let copies = route_dims < e && !carried;
                carried |= copies;
                let v = if copies { Fill::Copy { std: 1.0 / (e as f32).sqrt(), gain: 1.0, dims: route_dims } } else { dense(e) };
                add(blk("attn_v.weight"), attn_v_type(), vec![e, hkv * hd], v);
                if f.qkv_bias {
                    add(blk("attn_q.bias"), f32t, vec![q_width], bias.clone());
                    add(blk("attn_k.bias"), f32t, vec![hkv * hd], bias.clone());
                    add(blk("attn_v.bias"), f32t, vec![hkv * hd], bias.clone());
                }
                let o = if copies {
                    Fill::Copy { std: self.context_gain / ((h * hd) as f32).sqrt(), gain: self.carry, dims: route_dims }
                } else {
                    mixer_out(h * hd)
                };
                add(blk("attn_output.weight"), q4k, vec![h * hd, e], o);
                if f.out_bias {
                    add(blk("attn_output.bias"), f32t, vec![e], bias.clone());
                }
                if f.qk_norm {
                    add(blk("attn_q_norm.weight"), f32t, vec![hd], one.clone());
                    add(blk("attn_k_norm.weight"), f32t, vec![hd], one.clone());
                }
                if f.sinks {
                    add(blk("attn_sinks.weight"), f32t, vec![h], Fill::Uniform(-1.0, 1.0));
                }
            }
            match f.norms {
                Norms::FfnNorm => add(blk("ffn_norm.weight"), f32t, vec![e], one.clone()),
                Norms::PostAttention => add(blk("post_attention_norm.weight"), f32t, vec![e], one.clone()),
                Norms::Gemma => {
                    for n in ["post_attention_norm", "ffn_norm", "post_ffw_norm", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"] {
                        add(blk(&format!("{n}.weight")), f32t, vec![e], one.clone());
                    }
                }
            }
            let fd = self.n_ff_dense;
            if !self.is_moe(il) || f.shared == Shared::DenseMlp {
                add(blk("ffn_gate.weight"), q4k, vec![e, fd], dense(e));
                add(blk("ffn_up.weight"), q4k, vec![e, fd], dense(e));
                add(blk("ffn_down.weight"), more, vec![fd, e], residual(fd));
            }
            if !self.is_moe(il) {
                continue;
            }
            let (x, ff) = (self.n_expert, self.n_ff_exp);
            add(
                blk("ffn_gate_inp.weight"),
                f32t,
                vec![e, x],
                Fill::Router { std: 1.0 / (e as f32).sqrt(), skew: self.router_skew, layer: il, dims: route_dims },
            );
            match f.router {
                Router::Softmax => {}
                Router::SoftmaxBias => add(blk("ffn_gate_inp.bias"), f32t, vec![x], bias.clone()),
                Router::SigmoidBias => add(blk("exp_probs_b.bias"), f32t, vec![x], Fill::Uniform(0.0, 0.1)),
                Router::ScaledInput => add(blk("ffn_gate_inp.scale"), f32t, vec![e], one.clone()),
            }
            let gate_up_ty = self.expert_type.unwrap_or(q4k);
            let down_ty = self.expert_type.unwrap_or(more);
            if self.fused_gate_up {
                add(blk("ffn_gate_up_exps.weight"), gate_up_ty, vec![e, 2 * ff, x], dense(e));
            } else {
                add(blk("ffn_gate_exps.weight"), gate_up_ty, vec![e, ff, x], dense(e));
                add(blk("ffn_up_exps.weight"), gate_up_ty, vec![e, ff, x], dense(e));
            }
            add(blk("ffn_down_exps.weight"), down_ty, vec![ff, e, x], residual(ff));
            if f.expert_bias {
                add(blk("ffn_gate_exps.bias"), f32t, vec![ff, x], bias.clone());
                add(blk("ffn_up_exps.bias"), f32t, vec![ff, x], bias.clone());
                add(blk("ffn_down_exps.bias"), f32t, vec![e, x], bias.clone());
            }
            if f.down_scale {
                add(blk("ffn_down_exps.scale"), f32t, vec![x], Fill::Uniform(0.5, 1.5));
            }
            let fs = match f.shared {
                Shared::Gated => {
                    add(blk("ffn_gate_inp_shexp.weight"), f32t, vec![e], dense(e));
                    self.n_ff_shexp
                }
                Shared::Counted => ff * self.n_expert_shared,
                Shared::None | Shared::DenseMlp => 0,
            };
            if fs > 0 {
                add(blk("ffn_gate_shexp.weight"), q4k, vec![e, fs], dense(e));
                add(blk("ffn_up_shexp.weight"), q4k, vec![e, fs], dense(e));
                add(blk("ffn_down_shexp.weight"), more, vec![fs, e], residual(fs));
            }
            if il >= self.n_layer {
                add(blk("nextn.eh_proj.weight"), q4k, vec![2 * e, e], dense(2 * e));
                add(blk("nextn.enorm.weight"), f32t, vec![e], one.clone());
                add(blk("nextn.hnorm.weight"), f32t, vec![e], one.clone());
                add(blk("nextn.shared_head_norm.weight"), f32t, vec![e], one.clone());
            }
        }
        add("output_norm.weight".into(), f32t, vec![e], one);
        let head = if route_dims < e { Fill::DenseAfter { std: 1.0 / (e as f32).sqrt(), skip: route_dims } } else { dense(e) };
        add("output.weight".into(), q6k, vec![e, v], head);
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

    /// gpt-oss-120b as OpenAI ships it: MXFP4 experts at its full width (rows
    /// of 2880, which no K-quant fits), 36 × 128 experts of 13.2 MB.
    #[test]
    fn gpt_oss_120b_has_mxfp4_experts_at_full_width() {
        let spec = ModelSpec::preset("gpt-oss-120b").unwrap();
        spec.validate().unwrap();
        let plan = spec.plan();
        let experts: Vec<&PlannedTensor> = plan.iter().filter(|t| t.name.ends_with("_exps.weight")).collect();
        assert_eq!(experts.len(), 36 * 3);
        assert!(experts.iter().all(|t| t.ty == GgmlType::MXFP4), "{:?}", experts.iter().map(|t| t.ty.name()).collect::<Vec<_>>());
        // 90 blocks of 17 bytes per row of 2880.
        assert_eq!(bytes_where(&plan, |n| n.ends_with("_exps.weight")), 3 * 36 * 128 * 2880 * 1530);
        assert_eq!(bytes_where(&plan, |n| n.starts_with("blk.0.") && n.ends_with("_exps.weight")) / 128, 13_219_200);
        assert!(plan.iter().any(|t| t.name == "blk.35.attn_sinks.weight"));
        assert_eq!((0..36).filter(|&il| spec.is_swa(il)).count(), 18);
        let embd = plan.iter().find(|t| t.name == "token_embd.weight").unwrap();
        assert_eq!(embd.ne, vec![2880, 201_088]);
    }

    /// DeepSeek-V3's geometry: 3 dense layers of 18,432, then 58 of 256
    /// experts of 2048 in 8 groups, MLA with ranks 1536/512.
    #[test]
    fn deepseek_v3_is_valid_and_takes_low_bit_experts() {
        let spec = ModelSpec::preset("deepseek-v3").unwrap();
        spec.validate().unwrap();
        assert_eq!((spec.n_layer, spec.n_layer_dense_lead, spec.rope_dim(), spec.mla_value_dim()), (61, 3, 64, 128));
        let plan = spec.plan();
        assert!(plan.iter().any(|t| t.name == "blk.2.ffn_down.weight" && t.ne == vec![18_432, 7168]));
        assert!(!plan.iter().any(|t| t.name == "blk.2.ffn_gate_exps.weight"));
        let gate = plan.iter().find(|t| t.name == "blk.3.ffn_gate_exps.weight").unwrap();
        assert_eq!((gate.ty, gate.ne.clone()), (GgmlType::Q4_K, vec![7168, 2048, 256]));
        for t in ["q2_K", "q3_K", "q4_K"] {
            let mut s = spec.clone();
            s.expert_type = GgmlType::from_name(t);
            s.validate().unwrap();
            let ty = s.plan().into_iter().find(|p| p.name == "blk.60.ffn_down_exps.weight").unwrap().ty;
            assert_eq!(ty.name(), t);
        }
    }

    /// `--routing trained` is calibrated per family at the tiny geometry and
    /// per preset where a full-size model was measured.
    #[test]
    fn full_size_presets_keep_their_own_trained_routing() {
        let mut tiny = ModelSpec::preset("tiny").unwrap();
        assert_eq!(tiny.trained_routing(), (0.25, 1.5, 0.0, 16.0));
        tiny.set_arch(Arch::GptOss);
        assert_eq!(tiny.trained_routing(), (0.0, 1.0, 11.0, 2.0));
        tiny.set_arch(Arch::DeepSeek2);
        assert_eq!(tiny.trained_routing(), (0.1, 0.65, 10.0, 0.0));
        assert_eq!(ModelSpec::preset("gpt-oss-120b").unwrap().trained_routing(), (0.1, 0.5, 8.0, 1.0));
        assert_eq!(ModelSpec::preset("35b-a3b").unwrap().trained_routing(), (0.5, 1.0, 0.0, 9.0));
        assert_eq!(ModelSpec::preset("deepseek-v3").unwrap().trained_routing(), (1.0, 0.5, 8.0, 0.0));
    }

    /// Carry copies in the first attention layer only (qwen35moe's is layer
    /// 3), routers read the head_dim-wide routing subspace, and the output
    /// head is blind to it; without carry nothing of it is planned.
    #[test]
    fn carry_copies_once_into_a_subspace_the_output_head_skips() {
        let mut spec = ModelSpec::preset("tiny").unwrap();
        spec.carry = 4.0;
        let plan = spec.plan();
        let copies: Vec<&str> = plan.iter().filter(|t| matches!(t.fill, Fill::Copy { .. })).map(|t| t.name.as_str()).collect();
        assert_eq!(copies, ["blk.3.attn_v.weight", "blk.3.attn_output.weight"]);
        assert!(plan.iter().any(|t| t.name == "blk.7.attn_v.weight" && matches!(t.fill, Fill::Dense { .. })));
        let dims = spec.head_dim;
        assert!(plan.iter().filter(|t| t.name.ends_with("ffn_gate_inp.weight")).all(|t| matches!(t.fill, Fill::Router { dims: d, .. } if d == dims)));
        assert!(plan.iter().any(|t| t.name == "output.weight" && t.fill == Fill::DenseAfter { std: 1.0 / (spec.n_embd as f32).sqrt(), skip: dims }));
        spec.carry = 0.0;
        let plain = spec.plan();
        assert!(plain.iter().all(|t| !matches!(t.fill, Fill::Copy { .. } | Fill::DenseAfter { .. })));
        assert!(plain.iter().filter(|t| t.name.ends_with("ffn_gate_inp.weight")).all(|t| matches!(t.fill, Fill::Router { dims: d, .. } if d == spec.n_embd)));
    }

    #[test]
    fn recency_takes_the_fastest_rotary_pairs_of_each_layout() {
        // 64 rotary dims at base 10,000: pairs 0-5 turn at least 0.2 radian a token.
        let neox = RotaryRows { period: 128, offset: 0, dims: 64, neox: true, base: 10_000.0 };
        assert_eq!(neox.fast_pair(0), Some((1.0, true)));
        assert_eq!(neox.fast_pair(32), Some((1.0, false)));
        assert!(neox.fast_pair(5).is_some() && neox.fast_pair(6).is_none() && neox.fast_pair(38).is_none());
        assert_eq!(neox.fast_pair(64), None, "rows past the rotary dims of a gated query's head");
        assert_eq!(neox.fast_pair(128), Some((1.0, true)), "the next head");
        // DeepSeek's query head: 128 dims without rope, then 64 with, in pairs (j, j + 1).
        let norm = RotaryRows { period: 192, offset: 128, dims: 64, neox: false, base: 10_000.0 };
        assert_eq!((norm.fast_pair(127), norm.fast_pair(128), norm.fast_pair(129)), (None, Some((1.0, true)), Some((1.0, false))));
        assert!(norm.fast_pair(128 + 11).is_some() && norm.fast_pair(128 + 12).is_none());
    }

    #[test]
    fn tiny_is_small_and_valid() {
        let spec = ModelSpec::preset("tiny").unwrap();
        spec.validate().unwrap();
        let total: u64 = spec.plan().iter().map(|t| t.nbytes()).sum();
        assert!(total < 100 << 20, "tiny is {total} bytes");
    }
}
