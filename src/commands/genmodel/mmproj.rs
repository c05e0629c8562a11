//! A synthetic MiniCPM-V 4.6 projector (`clip.projector_type = minicpmv4_6`)
//! for a generated text model: the file `llama-mtmd-cli --mmproj` and
//! `llama-server --mmproj` load beside it. A SigLIP-style ViT (patch
//! embedding, learned positions in SigLIP's 70×70 buckets, pre-norm blocks),
//! the ViT merger after block `insert` (window attention over 2×2 windows and
//! a 2×2 downsample MLP), and the final 2×2 merger MLP into the text model's
//! embedding width, with the pinned tree's tensor names and keys. Weights are
//! random (F16 matrices, F32 norms and biases): it exercises the memory and
//! the code paths of real images, not their meaning.
//!
//! Why 4.6: it is the projector the target model (MiniCPM-V 4.7, a
//! `qwen35moe` text model) ships with in the pinned tree's converter, the
//! `minicpmv4_6` type; the older `minicpmv` versions use a resampler with a
//! fixed query count instead of the merger.

use super::spec::{Fill, ModelSpec, PlannedTensor};
use crate::engine::ffi::ggml::GgmlType;
use crate::engine::model::gguf::{Array, GgufBuilder, Value};
use crate::error::{Error, Result};

/// The vision tower's geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Projector {
    pub n_embd: i64,
    pub n_head: i64,
    pub n_ff: i64,
    pub n_layer: i64,
    /// The ViT merger runs after this block.
    pub insert: i64,
    pub patch: i64,
    pub image_size: i64,
    /// Width of the two merger MLPs.
    pub merger_ff: i64,
    /// The text model's embedding width.
    pub proj_dim: i64,
}

/// SigLIP's position buckets: positions are bucket_h × 70 + bucket_w.
const POSITION_BUCKETS: i64 = 70 * 70;

/// The image tokens mtmd's MiniCPM-V template looks up in the text model's vocabulary.
pub const IMAGE_TOKENS: [&str; 4] = ["<image>", "</image>", "<slice>", "</slice>"];

impl Projector {
    /// The tower by name: `small` (3 blocks of width 128 at 224 px, 5 MB:
    /// tests load it in a second) or `so400m` (SigLIP-so400m's 27 blocks of
    /// width 1152 at MiniCPM-V's 448 px slices, about 0.9 GB in F16, the size
    /// of the target's `mmproj-model-f16.gguf`), into `text`'s width.
    pub fn named(name: &str, text: &ModelSpec) -> Result<Projector> {
        let proj_dim = text.n_embd;
        match name {
            "small" => Ok(Projector { n_embd: 128, n_head: 2, n_ff: 256, n_layer: 3, insert: 1, patch: 14, image_size: 224, merger_ff: 512, proj_dim }),
            // After block 6: the pinned tree's converter's default
            // `insert_layer_id` (conversion/minicpm.py). It matters: the
            // blocks after the ViT merger see a quarter of the tokens.
            "so400m" => Ok(Projector { n_embd: 1152, n_head: 16, n_ff: 4304, n_layer: 27, insert: 6, patch: 14, image_size: 448, merger_ff: 4608, proj_dim }),
            other => Err(Error::invalid(format!("unknown projector size '{other}' (small, so400m)"))),
        }
    }

    /// The tower for a model of preset `preset`: the real size for the target
    /// geometry, the small one otherwise.
    pub fn default_for(preset: &str) -> &'static str {
        if preset == "35b-a3b" {
            "so400m"
        } else {
            "small"
        }
    }

    /// The tensors, in file order.
    pub fn plan(&self) -> Vec<PlannedTensor> {
        let n = self.n_embd;
        let mut out = Vec::new();
        let mut t = |name: String, ty: GgmlType, ne: Vec<i64>, fill: Fill| out.push(PlannedTensor { name, ty, ne, fill });
        let w = |fan_in: i64| Fill::Dense { std: 1.0 / (fan_in as f32).sqrt() };
        let one = Fill::Const(1.0);
        let zero = Fill::Const(0.0);
        let (f16, f32) = (GgmlType::F16, GgmlType::F32);
        t("v.patch_embd.weight".into(), f16, vec![self.patch, self.patch, 3, n], w(self.patch * self.patch * 3));
        t("v.patch_embd.bias".into(), f32, vec![n], zero.clone());
        t("v.position_embd.weight".into(), f32, vec![n, POSITION_BUCKETS], Fill::Dense { std: 0.02 });
        for il in 0..self.n_layer {
            let p = format!("v.blk.{il}");
            for x in ["attn_q", "attn_k", "attn_v", "attn_out"] {
                t(format!("{p}.{x}.weight"), f16, vec![n, n], w(n));
                t(format!("{p}.{x}.bias"), f32, vec![n], zero.clone());
            }
            for x in ["ln1", "ln2"] {
                t(format!("{p}.{x}.weight"), f32, vec![n], one.clone());
                t(format!("{p}.{x}.bias"), f32, vec![n], zero.clone());
            }
            t(format!("{p}.ffn_up.weight"), f16, vec![n, self.n_ff], w(n));
            t(format!("{p}.ffn_up.bias"), f32, vec![self.n_ff], zero.clone());
            t(format!("{p}.ffn_down.weight"), f16, vec![self.n_ff, n], w(self.n_ff));
            t(format!("{p}.ffn_down.bias"), f32, vec![n], zero.clone());
        }
        t("v.post_ln.weight".into(), f32, vec![n], one.clone());
        t("v.post_ln.bias".into(), f32, vec![n], zero.clone());
        // The ViT merger: window attention, then 4 tokens → 1 by an MLP.
        t("v.vit_merger.ln1.weight".into(), f32, vec![n], one.clone());
        t("v.vit_merger.ln1.bias".into(), f32, vec![n], zero.clone());
        for x in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            t(format!("v.vit_merger.{x}.weight"), f16, vec![n, n], w(n));
            t(format!("v.vit_merger.{x}.bias"), f32, vec![n], zero.clone());
        }
        t("v.vit_merger.ds_ln.weight".into(), f32, vec![4 * n], one.clone());
        t("v.vit_merger.ds_ln.bias".into(), f32, vec![4 * n], zero.clone());
        t("v.vit_merger.ds_ffn_up.weight".into(), f16, vec![4 * n, self.merger_ff], w(4 * n));
        t("v.vit_merger.ds_ffn_up.bias".into(), f32, vec![self.merger_ff], zero.clone());
        t("v.vit_merger.ds_ffn_down.weight".into(), f16, vec![self.merger_ff, n], w(self.merger_ff));
        t("v.vit_merger.ds_ffn_down.bias".into(), f32, vec![n], zero.clone());
        // The final merger: 4 tokens → 1, into the text model's width.
        t("mm.input_norm.weight".into(), f32, vec![4 * n], one.clone());
        t("mm.input_norm.bias".into(), f32, vec![4 * n], zero.clone());
        t("mm.up.weight".into(), f16, vec![4 * n, self.merger_ff], w(4 * n));
        t("mm.up.bias".into(), f32, vec![self.merger_ff], zero.clone());
        t("mm.down.weight".into(), f16, vec![self.merger_ff, self.proj_dim], w(self.merger_ff));
        t("mm.down.bias".into(), f32, vec![self.proj_dim], zero);
        out
    }

    /// The keys the pinned tree's clip loader reads for this projector.
    pub fn write_metadata(&self, b: &mut GgufBuilder) {
        let u = |v: i64| Value::U32(u32::try_from(v).expect("small geometry"));
        b.set("general.architecture", &Value::Str("clip".into()));
        b.set("general.name", &Value::Str("sdq generated MiniCPM-V 4.6 projector".into()));
        b.set("general.file_type", &Value::U32(1)); // mostly F16
        b.set("clip.has_vision_encoder", &Value::Bool(true));
        b.set("clip.projector_type", &Value::Str("minicpmv4_6".into()));
        b.set("clip.use_gelu", &Value::Bool(true));
        b.set("clip.vision.image_size", &u(self.image_size));
        b.set("clip.vision.patch_size", &u(self.patch));
        b.set("clip.vision.embedding_length", &u(self.n_embd));
        b.set("clip.vision.feed_forward_length", &u(self.n_ff));
        b.set("clip.vision.block_count", &u(self.n_layer));
        b.set("clip.vision.projection_dim", &u(self.proj_dim));
        b.set("clip.vision.attention.head_count", &u(self.n_head));
        b.set("clip.vision.attention.layer_norm_epsilon", &Value::F32(1e-6));
        b.set("clip.vision.image_mean", &Value::Array(Array::F32(vec![0.5; 3])));
        b.set("clip.vision.image_std", &Value::Array(Array::F32(vec![0.5; 3])));
        b.set("clip.vision.projector.scale_factor", &Value::U32(4));
        b.set("clip.vision.wa_layer_indexes", &Value::Array(Array::I32(vec![self.insert as i32])));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_so400m_tower_is_the_size_of_the_targets_f16_projector() {
        let text = ModelSpec::preset("35b-a3b").unwrap();
        let bytes: u64 = Projector::named("so400m", &text).unwrap().plan().iter().map(|t| t.nbytes()).sum();
        // SigLIP-so400m in F16 is ~0.86 GB; the mergers add ~0.1 GB.
        assert!((850_000_000..1_050_000_000).contains(&bytes), "{bytes}");
        assert_eq!(Projector::default_for("35b-a3b"), "so400m");
        assert_eq!(Projector::default_for("tiny"), "small");
        assert!(Projector::named("huge", &text).unwrap_err().to_string().contains("unknown projector size 'huge'"));
    }
}
