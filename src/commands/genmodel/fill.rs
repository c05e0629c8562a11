//! Generating tensor values and quantizing them with ggml, in parallel chunks
//! that are deterministic from the seed whatever the thread count.

use super::spec::{Carrier, Fill, ModelSpec, PlannedTensor};
use crate::engine::ffi::ggml::quantize_rows;
use std::collections::HashMap;
use std::io;

/// Elements generated and quantized per work unit (4 MiB of f32).
const CHUNK_ELEMS: i64 = 1 << 20;

/// splitmix64: a tiny, fast, well-mixed generator; seeds each chunk independently.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform on [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform on [-sqrt(3), sqrt(3)): zero mean, unit variance, and cheap.
    fn unit(&mut self) -> f32 {
        (self.next_f32() * 2.0 - 1.0) * 1.732_050_8
    }
}

/// A seed for tensor `name` of a model seeded with `seed` (FNV-1a over the name).
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x100_0000_01b3);
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The shared direction u (entries ±1) that embeddings carry and routers key on.
fn shared_direction(spec: &ModelSpec) -> Vec<f32> {
    let mut rng = Rng::new(tensor_seed(spec.seed, "sdq.u"));
    (0..spec.n_embd).map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }).collect()
}

/// The latent direction a (entries ±1) that DeepSeek's query compression
/// carries under recency.
fn latent_direction(spec: &ModelSpec) -> Vec<f32> {
    let mut rng = Rng::new(tensor_seed(spec.seed, "sdq.a"));
    (0..spec.q_lora_rank).map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }).collect()
}

/// Per-expert router biases for one layer: normal quantiles in a per-layer random order.
fn router_biases(spec: &ModelSpec, layer: u32) -> Vec<f32> {
    let n = spec.n_expert as usize;
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Rng::new(tensor_seed(spec.seed, &format!("sdq.router_order.{layer}")));
    for i in (1..n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    // Tukey's lambda approximation of the normal quantile function (within ~1 %).
    let probit = |p: f32| 4.91 * (p.powf(0.14) - (1.0 - p).powf(0.14));
    order.iter().map(|&rank| probit((rank as f32 + 0.5) / n as f32)).collect()
}

/// Context a fill needs beyond the element's position.
struct FillContext {
    u: Vec<f32>,
    biases: Vec<f32>,
    /// The latent direction, for fills that read or write it.
    a: Vec<f32>,
}

impl FillContext {
    fn new(spec: &ModelSpec, fill: &Fill) -> FillContext {
        let biases = match fill {
            Fill::Router { layer, .. } => router_biases(spec, *layer),
            _ => Vec::new(),
        };
        let u = match fill {
            Fill::Embedding { .. } | Fill::Router { .. } | Fill::LatentCarrier { .. } | Fill::Recency { carrier: Carrier::Shared, .. } => {
                shared_direction(spec)
            }
            _ => Vec::new(),
        };
        let a = match fill {
            Fill::LatentCarrier { .. } | Fill::Recency { carrier: Carrier::Latent, .. } => latent_direction(spec),
            _ => Vec::new(),
        };
        FillContext { u, biases, a }
    }

    /// Fills `out` with rows `first_row..` of a tensor whose rows are `n0` long.
    fn fill_rows(&self, fill: &Fill, rng: &mut Rng, first_row: i64, n0: usize, out: &mut [f32]) {
        match *fill {
            Fill::Const(c) => out.fill(c),
            Fill::Uniform(lo, hi) => out.iter_mut().for_each(|x| *x = lo + (hi - lo) * rng.next_f32()),
            Fill::Dense { std } => out.iter_mut().for_each(|x| *x = std * rng.unit()),
            Fill::DenseAfter { std, skip } => {
                for row in out.chunks_exact_mut(n0) {
                    for (c, x) in row.iter_mut().enumerate() {
                        let v = std * rng.unit();
                        *x = if (c as i64) < skip { 0.0 } else { v };
                    }
                }
            }
            Fill::Copy { std, gain, dims } => {
                for (r, row) in out.chunks_exact_mut(n0).enumerate() {
                    let r = first_row + r as i64;
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = std * rng.unit() + if r < dims && c as i64 == r { gain } else { 0.0 };
                    }
                }
            }
            Fill::Embedding { std, u_gain } => {
                for row in out.chunks_exact_mut(n0) {
                    for (x, u) in row.iter_mut().zip(&self.u) {
                        *x = std * rng.unit() + u_gain * u;
                    }
                }
            }
            Fill::Router { std, skew, dims, .. } => {
                // A hidden state h (rms 1) has projection ≈ 0.7·n on u, so the
                // term skew·b_e·u/n adds about 0.7·skew·b_e to expert e's logit.
                let noise = Noise { std, dims: dims as usize };
                noise_along(out, n0, rng, noise, &self.u, |r| skew * self.biases[(first_row as usize + r) % self.biases.len()]);
            }
            Fill::Recency { std, gain, rows, carrier, query } => {
                // An input of rms 1 projects about 0.7·len onto its carrier
                // direction, so a fast row's output holds about 0.7·gain.
                // RoPE turns (x, y) at position p by p·θ; a key's (1, 0)
                // against a query's (cos θ, -sin θ) scores cos((1 - Δ)θ) at
                // a distance of Δ tokens.
                let dir = if carrier == Carrier::Shared { &self.u } else { &self.a };
                noise_along(out, n0, rng, Noise { std, dims: n0 }, dir, |r| match (rows.fast_pair(first_row + r as i64), query) {
                    (None, _) | (Some((_, false)), false) => 0.0,
                    (Some((_, true)), false) => gain,
                    (Some((angle, true)), true) => gain * angle.cos(),
                    (Some((angle, false)), true) => -gain * angle.sin(),
                });
            }
            Fill::LatentCarrier { std, gain } => {
                noise_along(out, n0, rng, Noise { std, dims: n0 }, &self.u, |r| gain * self.a[first_row as usize + r]);
            }
        }
    }
}

/// Noise of `std` on a row's first `dims` columns, scaled up by
/// sqrt(n0/dims) so that a dot product with it spreads as much as over the
/// whole row; the rest of the row gets none (its draws are still taken, so
/// the bytes with `dims` = n0 are what they were before `dims` existed).
#[derive(Clone, Copy)]
struct Noise {
    std: f32,
    dims: usize,
}

/// Rows of `n0` values: `noise`, plus in row r (counted from `out`'s
/// first) `gain(r)` times `dir` over its length. The fills that steer a
/// projection's output along a direction: routers, recency, the latent carrier.
fn noise_along(out: &mut [f32], n0: usize, rng: &mut Rng, noise: Noise, dir: &[f32], gain: impl Fn(usize) -> f32) {
    let n = n0 as f32;
    let std = if noise.dims < n0 { noise.std * (n / noise.dims as f32).sqrt() } else { noise.std };
    for (r, row) in out.chunks_exact_mut(n0).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            let v = std * rng.unit();
            *x = if c < noise.dims { v } else { 0.0 };
        }
        if noise.dims < n0 {
            // Restricted noise is also made orthogonal to `dir`, so that the
            // constant part of every hidden state favours no expert: only
            // `gain` does.
            let d = &dir[..noise.dims];
            let along = row[..noise.dims].iter().zip(d).map(|(x, d)| x * d).sum::<f32>() / d.iter().map(|d| d * d).sum::<f32>();
            row[..noise.dims].iter_mut().zip(d).for_each(|(x, d)| *x -= along * d);
        }
        let g = gain(r);
        row.iter_mut().zip(dir).for_each(|(x, d)| *x += g * d / n);
    }
}

/// Tensors with more rows than this, whose rows are independent of their
/// position, are assembled from a pool of this many quantized rows.
const POOL_ROWS: i64 = 16_384;

/// Row-independent tensors of more elements than this with too few rows for
/// that pool (DeepSeek-V3's attention output and dense FFN: 117–132 M weights
/// each, which ggml's quantizers take seconds over) are assembled from a
/// smaller pool of about `SMALL_POOL_ELEMS` elements.
const LARGE_TENSOR_ELEMS: i64 = 32 << 20;
const SMALL_POOL_ELEMS: i64 = 8 << 20;

/// Writes tensors' bytes. Small tensors are generated and quantized directly;
/// large row-independent ones (experts, embeddings, output) copy rows picked at
/// random from a pool that ggml quantized once, because ggml's reference
/// K-quantizers run at ~10 M weights/s per core and the 35B geometry has 40 G
/// weights. Every expert remains a distinct draw of real quantized rows.
pub struct TensorWriter<'a> {
    spec: &'a ModelSpec,
    threads: usize,
    pools: HashMap<String, Vec<u8>>,
}

impl<'a> TensorWriter<'a> {
    pub fn new(spec: &'a ModelSpec, threads: usize) -> TensorWriter<'a> {
        TensorWriter { spec, threads: threads.max(1), pools: HashMap::new() }
    }

    /// Generates tensor `t` and hands its bytes, in file order, to `sink`.
    pub fn write(&mut self, t: &PlannedTensor, sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
        let seed = tensor_seed(self.spec.seed, &t.name);
        let rows: i64 = t.ne[1..].iter().product();
        let row_independent = matches!(t.fill, Fill::Const(_) | Fill::Uniform(..) | Fill::Dense { .. } | Fill::DenseAfter { .. } | Fill::Embedding { .. });
        let small_pool = (SMALL_POOL_ELEMS / t.ne[0]).max(256);
        if row_independent && rows > 2 * POOL_ROWS {
            self.write_pooled(t, seed, POOL_ROWS, sink)
        } else if row_independent && rows * t.ne[0] > LARGE_TENSOR_ELEMS && rows > 2 * small_pool {
            self.write_pooled(t, seed, small_pool, sink)
        } else {
            write_direct(self.spec, t, seed, self.threads, sink)
        }
    }

    fn write_pooled(&mut self, t: &PlannedTensor, seed: u64, pool_rows: i64, sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
        let n0 = t.ne[0];
        let row_bytes = t.ty.row_size(n0);
        // The first pools' names are kept as they were, so that models
        // generated before the small pools existed keep their bytes.
        let key =
            if pool_rows == POOL_ROWS { format!("{}/{}/{:?}", t.ty.name(), n0, t.fill) } else { format!("{}/{}/{:?}/{pool_rows}", t.ty.name(), n0, t.fill) };
        if !self.pools.contains_key(&key) {
            let pool_tensor = PlannedTensor { name: format!("sdq.pool.{key}"), ty: t.ty, ne: vec![n0, pool_rows], fill: t.fill.clone() };
            let mut pool = Vec::with_capacity(pool_tensor.nbytes() as usize);
            let pool_seed = tensor_seed(self.spec.seed, &pool_tensor.name);
            write_direct(self.spec, &pool_tensor, pool_seed, self.threads, &mut |b| {
                pool.extend_from_slice(b);
                Ok(())
            })?;
            self.pools.insert(key.clone(), pool);
        }
        let pool = &self.pools[&key];
        let rows: i64 = t.ne[1..].iter().product();
        let rows_per_chunk = (CHUNK_ELEMS / n0).max(1);
        let mut buf = Vec::with_capacity(row_bytes * rows_per_chunk as usize);
        let mut first = 0;
        while first < rows {
            let nrows = rows_per_chunk.min(rows - first);
            let mut rng = Rng::new(seed ^ (first as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
            buf.clear();
            for _ in 0..nrows {
                let r = (rng.next_u64() % pool_rows as u64) as usize;
                buf.extend_from_slice(&pool[r * row_bytes..(r + 1) * row_bytes]);
            }
            sink(&buf)?;
            first += nrows;
        }
        Ok(())
    }
}

/// Generates and quantizes tensor `t` in chunks of whole rows on `threads`
/// threads; each chunk's values depend only on (seed, chunk index).
fn write_direct(spec: &ModelSpec, t: &PlannedTensor, seed: u64, threads: usize, sink: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    let n0 = t.ne[0];
    let rows: i64 = t.ne[1..].iter().product();
    let rows_per_chunk = (CHUNK_ELEMS / n0).max(1);
    let n_chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    let row_bytes = t.ty.row_size(n0);
    let ctx = FillContext::new(spec, &t.fill);
    let threads = threads.max(1) as i64;

    let make_chunk = |c: i64| -> Vec<u8> {
        let first = c * rows_per_chunk;
        let nrows = rows_per_chunk.min(rows - first);
        let mut values = vec![0f32; (nrows * n0) as usize];
        let mut rng = Rng::new(seed ^ (c as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        ctx.fill_rows(&t.fill, &mut rng, first, n0 as usize, &mut values);
        let mut bytes = vec![0u8; row_bytes * nrows as usize];
        quantize_rows(t.ty, &values, n0, &mut bytes);
        bytes
    };

    let mut c = 0;
    while c < n_chunks {
        let batch = threads.min(n_chunks - c);
        let chunks: Vec<Vec<u8>> = if batch == 1 {
            vec![make_chunk(c)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = (c..c + batch).map(|i| s.spawn(move || make_chunk(i))).collect();
                handles.into_iter().map(|h| h.join().expect("quantizer thread")).collect()
            })
        };
        for chunk in &chunks {
            sink(chunk)?;
        }
        c += batch;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_biases_are_a_permutation_of_spread_quantiles() {
        let spec = ModelSpec::preset("tiny").unwrap();
        let mut b = router_biases(&spec, 3);
        assert_ne!(b, router_biases(&spec, 4), "layers get different orders");
        b.sort_by(f32::total_cmp);
        assert!(b[0] < -1.5 && b[b.len() - 1] > 1.5, "spread {b:?}");
        assert!((b.iter().sum::<f32>()).abs() < 1e-3, "symmetric quantiles sum to 0");
    }

    #[test]
    fn chunks_do_not_depend_on_thread_count() {
        let spec = ModelSpec::preset("tiny").unwrap();
        let t = spec.plan().into_iter().find(|t| t.name == "blk.0.ffn_down_exps.weight").unwrap();
        let collect = |threads| {
            let mut out = Vec::new();
            TensorWriter::new(&spec, threads)
                .write(&t, &mut |b| {
                    out.extend_from_slice(b);
                    Ok(())
                })
                .unwrap();
            out
        };
        let one = collect(1);
        assert_eq!(one.len() as u64, t.nbytes());
        assert_eq!(one, collect(3));
    }
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    #[test]
    fn large_expert_tensors_are_distinct_draws_from_the_pool() {
        let mut spec = ModelSpec::preset("35b-a3b").unwrap();
        spec.n_layer = 1;
        spec.full_attention_interval = 1;
        let t = spec.plan().into_iter().find(|t| t.name == "blk.0.ffn_down_exps.weight").unwrap();
        let mut w = TensorWriter::new(&spec, 2);
        let mut out = Vec::new();
        w.write(&t, &mut |b| {
            out.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(out.len() as u64, t.nbytes());
        let per_expert = out.len() / 256;
        let experts: std::collections::HashSet<&[u8]> = out.chunks(per_expert).collect();
        assert_eq!(experts.len(), 256, "some experts are identical");
    }
}
