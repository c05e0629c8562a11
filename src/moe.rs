//! Expert compute: the ggml custom op that replaces `ggml_mul_mat_id` for a
//! paged expert weight. It multiplies exactly as ggml's CPU mul_mat_id does
//! without repacking (each activation row converted with `from_float` to the
//! weight's `vec_dot_type`, then one `vec_dot` per output value), so results
//! match that path bit for bit; the weights come from pinned arena slots.
//!
//! Work is split by expert, claimed dynamically: each of ggml's threads takes
//! the next expert nobody has taken, preferring one already in the arena,
//! pins it, computes all of its tokens and releases it at once. In a layer's
//! first matmul the first thread to arrive hands all of the batch's misses to
//! the pager's readers at once (`Pager::prepare`), so they are read in
//! parallel while resident experts are computed, and each missing expert is
//! computed as soon as it is read. Each output value belongs to one (token,
//! slot) pair, so threads never write the same memory and no reduction is
//! needed: which thread computes an expert, and when, does not change a bit
//! of the result. The router-weighted sum is llama.cpp's own ops, in its own
//! order.
//!
//! While decoding, the next layer's experts are predicted from this layer's
//! expert input (`predict_next`: the next layer's router applied to it) and
//! read ahead at low priority once this layer's own misses are submitted.
//!
//! This is an FFI entry point (ggml calls it on its worker threads): tensor
//! access here is raw, with each block's invariant stated.

use crate::ggml::DotKernels;
use crate::pager::layout::Part;
use crate::pager::{Count, Pager};
use crate::runtime::{self, fatal};
use crate::sys;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

/// What one paged matmul needs, fixed when the graph is built (graphs are
/// reused, so this lives as long as the process).
#[derive(Debug)]
pub struct PagedMatmul {
    pub name: String,
    pub layer: u32,
    pub part: Part,
    pub kernels: DotKernels,
    /// True for the first paged layer's down projection: it counts tokens.
    pub counts_tokens: bool,
}

/// The prediction of a later layer's experts, computed just before the
/// gate matmul of `layer` (see `hooks::build_prediction`).
#[derive(Debug)]
pub struct Predictor {
    pub layer: u32,
    pub next: u32,
    pub top_k: usize,
}

/// Predictions made but not yet acted on, by the layer that made them:
/// (next layer, experts best first).
type Predictions = Mutex<HashMap<u32, (u32, Vec<u32>)>>;

fn predictions() -> &'static Predictions {
    static P: OnceLock<Predictions> = OnceLock::new();
    P.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The op: reads the next layer's router logits [n_expert, n_tokens] and
/// keeps each token's top-k experts, ordered by how many tokens chose them
/// (then by logit), for the gate matmul of the same layer to prefetch.
///
/// # Safety
/// Called by ggml with `dst` built by `hooks::build_prediction` (src[0] is
/// an F32 matrix computed by ggml_mul_mat) and `userdata` pointing at a
/// leaked `Predictor`.
pub unsafe extern "C" fn predict_next(dst: *mut sys::ggml_tensor, ith: c_int, _nth: c_int, userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    let run = std::panic::catch_unwind(|| {
        // SAFETY: per this function's contract; ggml_mul_mat's result is a
        // contiguous F32 matrix of ne[0] × ne[1] values.
        let (logits, n_expert, n_tokens, op) = unsafe {
            let l = &*(*dst).src[0];
            let n = (l.ne[0] * l.ne[1]) as usize;
            (std::slice::from_raw_parts(l.data as *const f32, n), l.ne[0] as usize, l.ne[1] as usize, &*(userdata as *const Predictor))
        };
        let mut score: HashMap<u32, (usize, f32)> = HashMap::new();
        let mut order: Vec<usize> = Vec::with_capacity(n_expert);
        for t in 0..n_tokens {
            let row = &logits[t * n_expert..(t + 1) * n_expert];
            order.clear();
            order.extend(0..n_expert);
            let k = op.top_k.min(n_expert);
            order.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| row[b].total_cmp(&row[a]));
            for &e in &order[..k] {
                let s = score.entry(e as u32).or_insert((0, f32::NEG_INFINITY));
                s.0 += 1;
                s.1 = s.1.max(row[e]);
            }
        }
        let mut experts: Vec<(u32, (usize, f32))> = score.into_iter().collect();
        experts.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(b.1 .1.total_cmp(&a.1 .1)));
        let experts = experts.into_iter().map(|(e, _)| e).collect();
        predictions().lock().unwrap_or_else(|p| p.into_inner()).insert(op.layer, (op.next, experts));
    });
    if run.is_err() {
        fatal("internal error in the expert prediction");
    }
}

/// The (slot k, token t) pairs one expert serves.
type Uses = Vec<(i64, i64)>;

/// One call of a paged matmul (one graph node, all of ggml's threads): the
/// batch's experts and which are taken. The first thread to arrive creates it,
/// the last to leave removes it; ggml does not start the node again before
/// every thread has left it.
struct Call {
    experts: Vec<(i32, Arc<Uses>)>,
    taken: Vec<bool>,
    /// Misses `prepare` found no slot for: their acquire reads them.
    deferred: HashSet<u32>,
    left: usize,
}

fn calls() -> &'static Mutex<HashMap<usize, Call>> {
    static CALLS: OnceLock<Mutex<HashMap<usize, Call>>> = OnceLock::new();
    CALLS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Weight rows multiplied with every use before the next rows: 16 rows of a
/// 2048-wide Q4_K expert are 18 KiB, which stays in L1.
const ROW_BLOCK: usize = 16;

thread_local! {
    /// Converted activation rows (one per use of the expert being computed),
    /// reused across calls on this thread.
    static ACTIVATION: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Reads `ids[k, t]` (an I32 view that may be non-contiguous).
///
/// # Safety
/// `ids` must be a valid I32 tensor with k < ne0 and t < ne1.
unsafe fn expert_id(ids: &sys::ggml_tensor, k: i64, t: i64) -> i32 {
    // SAFETY: in bounds per the contract; nb gives the byte strides.
    unsafe { *((ids.data as *const u8).add(t as usize * ids.nb[1] + k as usize * ids.nb[0]) as *const i32) }
}

/// The op: dst[:, k, t] = as[:, :, ids[k, t]] · b[:, k % b.ne1, t].
///
/// # Safety
/// Called by ggml with `dst` built by `hooks::mul_mat_id` (src = as, b, ids)
/// and `userdata` pointing at a leaked `PagedMatmul`.
pub unsafe extern "C" fn paged_mul_mat_id(dst: *mut sys::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    let run = std::panic::catch_unwind(|| {
        // SAFETY: per this function's contract, dst and its sources are valid
        // tensors whose data ggml allocated for this graph, and userdata is a
        // PagedMatmul that is never freed.
        unsafe { compute(&mut *dst, ith as usize, nth as usize, &*(userdata as *const PagedMatmul)) }
    });
    if run.is_err() {
        fatal("internal error in the paged expert matmul");
    }
}

/// # Safety
/// As for `paged_mul_mat_id`.
unsafe fn compute(dst: &mut sys::ggml_tensor, ith: usize, nth: usize, op: &PagedMatmul) {
    // SAFETY: src[0..3] were set by ggml_custom_4d from the hook's arguments.
    let (w, b, ids) = unsafe { (&*dst.src[0], &*dst.src[1], &*dst.src[2]) };
    let (cols, rows) = (w.ne[0], w.ne[1]);
    let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
    let rt = runtime::get().unwrap_or_else(|| fatal("paged expert matmul without an sdq runtime"));
    let pager = rt.pager(n_used as usize);
    if op.counts_tokens && ith == 0 {
        rt.count_tokens(n_tokens as u64);
    }

    let kernels = &op.kernels;
    let act_bytes = kernels.activation_row_bytes(cols as usize);
    let key = dst as *const sys::ggml_tensor as usize;
    ACTIVATION.with_borrow_mut(|acts| {
        // SAFETY: ids is the I32 [n_used, n_tokens] routing of this call.
        while let Some((e, uses, count)) = unsafe { next_expert(key, nth, op, ids, pager) } {
            // Every use's activation row, converted once, before the expert is pinned.
            acts.resize(act_bytes * uses.len(), 0);
            for (&(k, t), act) in uses.iter().zip(acts.chunks_exact_mut(act_bytes)) {
                // SAFETY: b is F32 [cols, b.ne1, n_tokens] with contiguous rows
                // (checked when the op was built); k % ne1 and t are in range.
                let b_row = unsafe {
                    let p = (b.data as *const u8).add(t as usize * b.nb[2] + (k % b.ne[1]) as usize * b.nb[1]);
                    std::slice::from_raw_parts(p as *const f32, cols as usize)
                };
                kernels.convert_activation(b_row, act);
            }
            let expert = pager.acquire(op.layer, e, count).unwrap_or_else(|err| fatal(&err.to_string()));
            let weights = expert.part(op.part);
            let row_bytes = weights.len() / rows as usize;
            // A block of weight rows stays in cache while every use of the
            // expert is multiplied with it: the weights are streamed from
            // memory once per batch, not once per token. Each value is still
            // one vec_dot of one row and one activation, so no bit changes.
            for first in (0..rows as usize).step_by(ROW_BLOCK) {
                let block = first..(first + ROW_BLOCK).min(rows as usize);
                for (&(k, t), act) in uses.iter().zip(acts.chunks_exact(act_bytes)) {
                    // SAFETY: dst is F32 [rows, n_used, n_tokens], contiguous;
                    // the row (k, t) belongs to expert e alone, and e to this
                    // thread alone.
                    let out = unsafe {
                        let p = (dst.data as *mut u8).add(t as usize * dst.nb[2] + k as usize * dst.nb[1]);
                        std::slice::from_raw_parts_mut(p as *mut f32, rows as usize)
                    };
                    for r in block.clone() {
                        out[r] = kernels.dot(cols as usize, &weights[r * row_bytes..(r + 1) * row_bytes], act);
                    }
                }
            }
            drop(expert); // release the slot as soon as this expert is done
        }
    });
}

/// The next expert of call `key` for this thread to compute, with its uses
/// and how its acquire counts; None when every expert is taken (and this
/// thread leaves the call).
///
/// # Safety
/// `ids` must be this call's valid I32 routing tensor.
unsafe fn next_expert(key: usize, nth: usize, op: &PagedMatmul, ids: &sys::ggml_tensor, pager: &Pager) -> Option<(u32, Arc<Uses>, Count)> {
    let mut calls = calls().lock().unwrap_or_else(|p| p.into_inner());
    let call = calls.entry(key).or_insert_with(|| {
        let mut by_expert: BTreeMap<i32, Uses> = BTreeMap::new();
        for t in 0..ids.ne[1] {
            for k in 0..ids.ne[0] {
                // SAFETY: k < ne0 and t < ne1 of ids (this function's contract).
                let e = unsafe { expert_id(ids, k, t) };
                by_expert.entry(e).or_default().push((k, t));
            }
        }
        if let Some((&e, _)) = by_expert.iter().find(|(&e, _)| e < 0 || e as u64 >= u32::MAX as u64) {
            fatal(&format!("{}: router selected expert {e}", op.name));
        }
        // ggml runs a layer's gate (or fused gate_up) matmul first: it is
        // SwiGLU's first source, and it starts the batch's reads.
        let deferred = if matches!(op.part, Part::Gate | Part::GateUp) {
            let experts: Vec<u32> = by_expert.keys().map(|&e| e as u32).collect();
            let deferred = pager.prepare(op.layer, &experts).unwrap_or_else(|err| fatal(&err.to_string())).into_iter().collect();
            // This layer's misses are queued: now what the next layer will likely need.
            let predicted = predictions().lock().unwrap_or_else(|p| p.into_inner()).remove(&op.layer);
            if let Some((next, predicted)) = predicted {
                pager.prefetch(next, &predicted, op.layer);
            }
            deferred
        } else {
            HashSet::new()
        };
        let experts: Vec<(i32, Arc<Uses>)> = by_expert.into_iter().map(|(e, u)| (e, Arc::new(u))).collect();
        Call { taken: vec![false; experts.len()], experts, deferred, left: 0 }
    });
    let open = || (0..call.experts.len()).filter(|&i| !call.taken[i]);
    let pick = pager.first_ready(op.layer, open().map(|i| (i, call.experts[i].0 as u32))).or_else(|| open().next());
    match pick {
        Some(i) => {
            call.taken[i] = true;
            let e = call.experts[i].0 as u32;
            let count = if call.deferred.contains(&e) { Count::Nothing } else { Count::Later };
            Some((e, Arc::clone(&call.experts[i].1), count))
        }
        None => {
            call.left += 1;
            if call.left == nth {
                calls.remove(&key);
            }
            None
        }
    }
}
