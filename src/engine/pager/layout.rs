//! Where the routed experts are: the paged tensors the loader reported, and
//! per layer the file ranges of one expert's parts and their place in a slot.
//!
//! With direct I/O (`O_DIRECT`, the default where the file system allows it)
//! the disk writes straight into the slot: no page-cache copy, and no CPU
//! time taken from ggml's threads for one. Reads must then start and end on
//! 4 KiB boundaries of the file and of memory, but GGUF aligns tensors to 32
//! bytes only, so each part gets a region of its size rounded up to 4 KiB
//! plus 4 KiB, is read as the aligned superset of its range, and its bytes
//! start `head` bytes into the region.

use super::arena::slot_bytes;
use super::io::{FileStamp, DIRECT_ALIGN};
use crate::engine::ffi::ggml::{GgmlType, WeightLayout};
use crate::error::{Error, Result};
use crate::units::human;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

/// Which projection of an expert a tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    Gate,
    Up,
    /// Gate and up fused (gate rows first).
    GateUp,
    Down,
}

impl Part {
    /// Parses a routed-expert weight name, `blk.N.ffn_{gate,up,down,gate_up}_exps.weight`.
    pub fn from_tensor_name(name: &str) -> Option<(u32, Part)> {
        let rest = name.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: u32 = layer.parse().ok()?;
        let part = match rest {
            "ffn_gate_exps.weight" => Part::Gate,
            "ffn_up_exps.weight" => Part::Up,
            "ffn_gate_up_exps.weight" => Part::GateUp,
            "ffn_down_exps.weight" => Part::Down,
            _ => return None,
        };
        Some((layer, part))
    }
}

/// A routed-expert tensor as the loader placed it.
#[derive(Clone, Debug, PartialEq)]
pub struct PagedTensor {
    pub name: String,
    pub layer: u32,
    pub part: Part,
    pub ty: GgmlType,
    pub ne: [i64; 4],
    pub nb: [usize; 4],
    /// Index of the GGUF file (split part) holding the bytes.
    pub file: u32,
    /// Offset of expert 0's bytes in that file.
    pub offset: u64,
    /// The layout stock gives it in memory: a repacked expert is converted
    /// after its read (as many bytes as in the file).
    pub layout: WeightLayout,
}

/// One part of one layer's experts, as read into a slot.
#[derive(Clone, Debug)]
pub struct PartSpan {
    pub part: Part,
    pub ty: GgmlType,
    pub file: Arc<File>,
    pub path: PathBuf,
    /// The file as it was when opened (see `FileStamp`).
    pub stamp: FileStamp,
    /// File offset of expert 0.
    pub offset: u64,
    /// Bytes of one expert (the tensor's nb[2]); expert e starts at offset + e·bytes.
    pub bytes: usize,
    /// Bytes of one row (nb[1]).
    pub row_bytes: usize,
    /// Where this part's region starts inside a slot (4 KiB-aligned with
    /// direct I/O).
    pub slot_offset: usize,
    /// The file opened with O_DIRECT, if direct I/O is on and works there.
    pub direct: Option<Arc<File>>,
    /// The layout the part is converted into once read (stock's).
    pub layout: WeightLayout,
}

impl PartSpan {
    /// File offset of expert `e`'s bytes.
    pub fn file_offset(&self, e: u32) -> u64 {
        self.offset + e as u64 * self.bytes as u64
    }

    /// Where expert `e`'s bytes start inside this part's region: 0, or with
    /// direct I/O their offset from the 4 KiB boundary below them.
    pub fn head(&self, e: u32) -> usize {
        if self.direct.is_some() {
            (self.file_offset(e) % DIRECT_ALIGN as u64) as usize
        } else {
            0
        }
    }

    /// Bytes read from the file for expert `e` (the aligned superset with
    /// direct I/O).
    pub fn read_len(&self, e: u32) -> usize {
        if self.direct.is_some() {
            (self.head(e) + self.bytes).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
        } else {
            self.bytes
        }
    }

    /// Bytes of this part's region in a slot.
    fn region(&self) -> usize {
        if self.direct.is_some() {
            self.bytes.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN
        } else {
            self.bytes
        }
    }
}

/// One MoE layer's experts.
#[derive(Clone, Debug)]
pub struct LayerLayout {
    pub layer: u32,
    pub n_expert: u32,
    /// Parts in slot order: gate, up (or gate_up), down.
    pub parts: Vec<PartSpan>,
    /// Bytes of one expert (all parts).
    pub expert_bytes: usize,
    /// Bytes of a slot its parts occupy: expert_bytes, or with direct I/O
    /// the parts' aligned regions. Slot classes are by this size.
    pub slot_extent: usize,
    /// Index of this layer's slot class.
    pub class: usize,
}

impl LayerLayout {
    pub fn part(&self, part: Part) -> Option<&PartSpan> {
        self.parts.iter().find(|p| p.part == part)
    }
}

/// Every paged layer, and the distinct expert sizes (slot classes, ascending).
#[derive(Clone, Debug)]
pub struct Layout {
    pub layers: BTreeMap<u32, LayerLayout>,
    /// Each class's slot extent (see `LayerLayout::slot_extent`).
    pub class_bytes: Vec<usize>,
}

impl Layout {
    /// Builds the layout from the paged tensors and the model's file paths,
    /// opening each file once and checking every range against its length.
    /// With `direct`, each file is also opened with O_DIRECT where that
    /// works (else its experts are read through the page cache, with a notice).
    pub fn build(tensors: &[PagedTensor], files: &BTreeMap<u32, PathBuf>, direct: bool) -> Result<Layout> {
        // Per file: the descriptor, its stamp, and the O_DIRECT descriptor.
        type Opened = (Arc<File>, FileStamp, Option<Arc<File>>);
        let mut opened: BTreeMap<u32, Opened> = BTreeMap::new();
        for (&idx, path) in files {
            let f = File::open(path).map_err(|e| Error::io("cannot open model file", path, e))?;
            let stamp = FileStamp::of(&f).map_err(|e| Error::io("cannot stat", path, e))?;
            super::io::advise_random(&f);
            let d = if direct {
                super::io::open_direct(path)
                    .inspect_err(|e| log::warn!("{}: no direct I/O ({e}); experts are read through the page cache", path.display()))
                    .ok()
                    .map(Arc::new)
            } else {
                None
            };
            opened.insert(idx, (Arc::new(f), stamp, d));
        }
        let mut by_layer: BTreeMap<u32, Vec<&PagedTensor>> = BTreeMap::new();
        for t in tensors {
            by_layer.entry(t.layer).or_default().push(t);
        }
        let mut layers = BTreeMap::new();
        for (layer, mut ts) in by_layer {
            ts.sort_by_key(|t| t.part);
            let parts_present: Vec<Part> = ts.iter().map(|t| t.part).collect();
            let complete = matches!(parts_present.as_slice(), [Part::Gate, Part::Up, Part::Down] | [Part::GateUp, Part::Down]);
            if !complete {
                return Err(Error::model(format!("layer {layer}: paged expert tensors {parts_present:?} are not gate+up+down or gate_up+down")));
            }
            let n_expert = ts[0].ne[2];
            let mut parts = Vec::new();
            let mut slot_offset = 0;
            for t in ts {
                let path = files.get(&t.file).cloned().unwrap_or_default();
                let (file, stamp, direct) =
                    opened.get(&t.file).cloned().ok_or_else(|| Error::invalid(format!("tensor {}: no path for model file {}", t.name, t.file)))?;
                if t.ne[2] != n_expert || t.ne[3] != 1 {
                    return Err(Error::gguf(&path, format!("tensor {}: {} experts, layer has {n_expert}", t.name, t.ne[2])));
                }
                let bytes = t.nb[2];
                if t.nb[1] * t.ne[1] as usize != bytes {
                    return Err(Error::gguf(&path, format!("tensor {}: experts are not contiguous", t.name)));
                }
                let end = t.offset + bytes as u64 * n_expert as u64;
                if end > stamp.len {
                    return Err(Error::gguf(&path, format!("tensor {} runs to byte {end}, past the end of the file ({} bytes)", t.name, stamp.len)));
                }
                if let WeightLayout::Repacked(r) = t.layout {
                    if r.expert_bytes() != bytes {
                        return Err(Error::model(format!("tensor {}: {} experts are {} bytes, {bytes} in the file", t.name, r.name(), r.expert_bytes())));
                    }
                }
                let span =
                    PartSpan { part: t.part, ty: t.ty, file, path, stamp, offset: t.offset, bytes, row_bytes: t.nb[1], slot_offset, direct, layout: t.layout };
                slot_offset += span.region();
                parts.push(span);
            }
            let expert_bytes = parts.iter().map(|p| p.bytes).sum();
            layers.insert(layer, LayerLayout { layer, n_expert: n_expert as u32, parts, expert_bytes, slot_extent: slot_offset, class: 0 });
        }
        Ok(Layout::classified(layers))
    }

    /// The layout of `layers`, each given the class of its slot extent.
    fn classified(mut layers: BTreeMap<u32, LayerLayout>) -> Layout {
        let mut class_bytes: Vec<usize> = layers.values().map(|l| l.slot_extent).collect();
        class_bytes.sort_unstable();
        class_bytes.dedup();
        for l in layers.values_mut() {
            l.class = class_bytes.binary_search(&l.slot_extent).expect("listed size");
        }
        Layout { layers, class_bytes }
    }

    /// A layout of sizes alone, with no file behind it (for `sdq replay`
    /// and planning): (layer, experts, bytes per expert, slot extent).
    pub fn from_sizes(layers: impl IntoIterator<Item = (u32, u32, usize, usize)>) -> Layout {
        Layout::classified(
            layers
                .into_iter()
                .map(|(layer, n_expert, expert_bytes, slot_extent)| {
                    (layer, LayerLayout { layer, n_expert, parts: Vec::new(), expert_bytes, slot_extent, class: 0 })
                })
                .collect(),
        )
    }

    /// How many layers use each slot class.
    pub fn layers_per_class(&self) -> Vec<usize> {
        let mut n = vec![0; self.class_bytes.len()];
        for l in self.layers.values() {
            n[l.class] += 1;
        }
        n
    }

    /// Slots per class for an arena of `arena_bytes`: in proportion to demand
    /// (layers of the class × top-k), at least one layer's top-k, and never
    /// more than the class has experts. Errors with the minimum that would work.
    pub fn plan_slots(&self, arena_bytes: u64, top_k: usize) -> Result<Vec<(usize, usize)>> {
        let slot = slot_bytes;
        let layers = self.layers_per_class();
        let n_expert = self.layers.values().map(|l| l.n_expert as usize).max().unwrap_or(0);
        if top_k == 0 || top_k > n_expert {
            return Err(Error::model(format!("top-{top_k} of {n_expert} experts: nothing to plan slots for")));
        }
        let min = self.min_arena_bytes(top_k);
        if arena_bytes < min {
            return Err(Error::invalid(format!(
                "an arena of {} cannot hold one layer's top-{top_k} experts of each size (needs {})",
                human(arena_bytes),
                human(min)
            )));
        }
        // demand-weighted bytes per unit of scale
        let unit: u64 = self.class_bytes.iter().zip(&layers).map(|(&b, &l)| (l * top_k * slot(b)) as u64).sum();
        let scale = arena_bytes as f64 / unit as f64;
        let mut counts: Vec<usize> =
            layers.iter().map(|&l| ((l * top_k) as f64 * scale).floor() as usize).zip(&layers).map(|(c, &l)| c.clamp(top_k, l * n_expert)).collect();
        // Raising a class to its minimum may overshoot: shrink the others back.
        let bytes = |counts: &[usize]| -> u64 { counts.iter().zip(&self.class_bytes).map(|(&c, &b)| (c * slot(b)) as u64).sum() };
        while bytes(&counts) > arena_bytes {
            let (i, _) = counts.iter().enumerate().filter(|(_, &c)| c > top_k).max_by_key(|(_, &c)| c).expect("minimum fits");
            counts[i] -= 1;
        }
        Ok(self.class_bytes.iter().copied().zip(counts).collect())
    }

    /// One token cycle: the arena bytes one token's experts take when no two
    /// tokens share any (Σ over layers of top-k × slot). The arena's size in
    /// token cycles is how many tokens' experts its slots hold, as the pager
    /// counts them; expert bytes would leave out the slots' padding, which
    /// at small experts is a tenth of a cycle.
    pub fn token_cycle_bytes(&self, top_k: usize) -> u64 {
        self.layers.values().map(|l| (top_k * slot_bytes(self.class_bytes[l.class])) as u64).sum()
    }

    /// What one token reads when the arena holds none of its experts (Σ over
    /// layers of top-k × bytes per expert): reads scale with this, not with
    /// the slots.
    pub fn token_read_bytes(&self, top_k: usize) -> u64 {
        self.layers.values().map(|l| (top_k * l.expert_bytes) as u64).sum()
    }

    /// The slot bytes of the layer whose experts take the most: what an
    /// arena needs to hold every expert of any one layer.
    pub fn largest_layer_bytes(&self) -> u64 {
        self.layers.values().map(|l| l.n_expert as u64 * slot_bytes(self.class_bytes[l.class]) as u64).max().unwrap_or(0)
    }

    /// The smallest arena that runs: one layer's top-k slots of each class.
    pub fn min_arena_bytes(&self, top_k: usize) -> u64 {
        self.class_bytes.iter().map(|&b| (top_k * slot_bytes(b)) as u64).sum()
    }

    /// Drops every expert range from the page cache: what kernel readahead
    /// around neighbouring weights brought in during load.
    pub fn drop_cached(&self) {
        for l in self.layers.values() {
            for p in &l.parts {
                super::io::drop_cached(&p.file, p.offset, p.bytes as u64 * l.n_expert as u64);
            }
        }
    }

    /// Bytes of all routed experts.
    pub fn total_expert_bytes(&self) -> u64 {
        self.layers.values().map(|l| l.expert_bytes as u64 * l.n_expert as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(Part::from_tensor_name("blk.12.ffn_down_exps.weight"), Some((12, Part::Down)));
        assert_eq!(Part::from_tensor_name("blk.0.ffn_gate_up_exps.weight"), Some((0, Part::GateUp)));
        assert_eq!(Part::from_tensor_name("blk.0.ffn_down_shexp.weight"), None);
        assert_eq!(Part::from_tensor_name("blk.x.ffn_up_exps.weight"), None);
        assert_eq!(Part::from_tensor_name("output.weight"), None);
    }

    fn layout(sizes: &[usize], n_expert: u32) -> Layout {
        Layout::from_sizes(sizes.iter().enumerate().map(|(i, &b)| (i as u32, n_expert, b, b)))
    }

    #[test]
    fn slots_follow_demand_within_bounds() {
        // 20 layers of each size, like the 35B-A3B target.
        let sizes: Vec<usize> = (0..40).map(|i| if i % 2 == 0 { 2_039_808 } else { 1_769_472 }).collect();
        let l = layout(&sizes, 256);
        let arena = 6u64 << 30;
        let plan = l.plan_slots(arena, 8).unwrap();
        let used: u64 = plan.iter().map(|&(b, c)| (b.div_ceil(4096) * 4096 * c) as u64).sum();
        assert!(used <= arena && used > arena - 2 * 2_043_904, "used {used}");
        assert_eq!(plan[0].1, plan[1].1, "equal demand, equal slot counts");
        // Minimum: one layer's top-8 per class.
        let min = l.min_arena_bytes(8);
        assert_eq!(l.plan_slots(min, 8).unwrap().iter().map(|p| p.1).collect::<Vec<_>>(), vec![8, 8]);
        assert!(l.plan_slots(min - 1, 8).is_err());
        // More than everything: capped at every expert.
        let all = l.plan_slots(1 << 40, 8).unwrap();
        assert_eq!(all.iter().map(|p| p.1).collect::<Vec<_>>(), vec![20 * 256, 20 * 256]);
    }
}
