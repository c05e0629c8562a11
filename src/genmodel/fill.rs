//! Generating tensor values and quantizing them with ggml, in parallel chunks
//! that are deterministic from the seed whatever the thread count.

use super::spec::{Fill, ModelSpec, PlannedTensor};
use crate::ggml::quantize_rows;
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
}

impl FillContext {
    fn new(spec: &ModelSpec, fill: &Fill) -> FillContext {
        let biases = match fill {
            Fill::Router { layer, .. } => router_biases(spec, *layer),
            _ => Vec::new(),
        };
        let u = match fill {
            Fill::Embedding { .. } | Fill::Router { .. } => shared_direction(spec),
            _ => Vec::new(),
        };
        FillContext { u, biases }
    }

    /// Fills `out` with rows `first_row..` of a tensor whose rows are `n0` long.
    fn fill_rows(&self, fill: &Fill, rng: &mut Rng, first_row: i64, n0: usize, out: &mut [f32]) {
        match *fill {
            Fill::Const(c) => out.fill(c),
            Fill::Uniform(lo, hi) => out.iter_mut().for_each(|x| *x = lo + (hi - lo) * rng.next_f32()),
            Fill::Dense { std } => out.iter_mut().for_each(|x| *x = std * rng.unit()),
            Fill::Embedding { std, u_gain } => {
                for row in out.chunks_exact_mut(n0) {
                    for (x, u) in row.iter_mut().zip(&self.u) {
                        *x = std * rng.unit() + u_gain * u;
                    }
                }
            }
            Fill::Router { std, skew, .. } => {
                // A hidden state h (rms 1) has projection ≈ 0.7·n on u, so the
                // term skew·b_e·u/n adds about 0.7·skew·b_e to expert e's logit.
                let n = n0 as f32;
                for (r, row) in out.chunks_exact_mut(n0).enumerate() {
                    let b = self.biases[(first_row as usize + r) % self.biases.len()];
                    for (x, u) in row.iter_mut().zip(&self.u) {
                        *x = std * rng.unit() + skew * b * u / n;
                    }
                }
            }
        }
    }
}

/// Generates tensor `t` and hands its bytes, in file order, to `sink`.
/// Chunks of whole rows are filled and quantized on `threads` threads; each
/// chunk's values depend only on (seed, chunk index).
pub fn write_tensor(
    spec: &ModelSpec,
    t: &PlannedTensor,
    seed: u64,
    threads: usize,
    sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<()> {
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
            write_tensor(&spec, &t, 7, threads, &mut |b| {
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
