//! The ops beside the expert op that read the router's choice: recording it
//! to the trace (`--sdq-trace`) and predicting the next layer's experts
//! from the next layer's router, for the pager to read ahead.

use super::expert_id;
use crate::engine::ffi::sys;
use crate::engine::runtime;
use crate::engine::runtime::failure::{fatal, guard};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

/// The prediction of a later layer's experts, computed just before the
/// gate matmul of `layer` (see `hooks::build_prediction`).
#[derive(Debug)]
pub struct Predictor {
    pub layer: u32,
    pub next: u32,
    pub top_k: usize,
}

/// The recording of one layer's routing (`--sdq-trace`), fixed when the
/// graph is built: an op that copies the selected experts' ids and writes
/// them, with their router weights, to the trace.
#[derive(Debug)]
pub struct RoutingRecord {
    pub layer: u32,
    /// True for the first paged layer: its record starts a step.
    pub starts_step: bool,
}

/// The op: dst (I32 [n_used, n_tokens], contiguous) = ids, and the
/// routing goes to the trace, token by token.
///
/// # Safety
/// Called by ggml with `dst` built by `hooks::moe_routing` (src = ids, I32
/// [n_used, n_tokens]; weights, F32 [1, n_used, n_tokens]) and `userdata`
/// pointing at a leaked `RoutingRecord`.
pub unsafe extern "C" fn record_routing(dst: *mut sys::ggml_tensor, ith: c_int, _nth: c_int, userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    guard("the routing record", || {
        // SAFETY: per this function's contract.
        let (dst, ids, weights, op) = unsafe { (&mut *dst, &*(*dst).src[0], &*(*dst).src[1], &*(userdata as *const RoutingRecord)) };
        let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
        let mut rows = Vec::with_capacity((n_used * n_tokens) as usize);
        for t in 0..n_tokens {
            for k in 0..n_used {
                // SAFETY: k < ne0 and t < ne1 of ids; weights has the same
                // [k, t] extent in its dims 1 and 2 (checked at build), read
                // through its strides; dst is a fresh contiguous I32 tensor
                // of ids' shape.
                let (e, w) = unsafe {
                    let e = expert_id(ids, k, t);
                    *(dst.data as *mut i32).add((t * n_used + k) as usize) = e;
                    (e, *((weights.data as *const u8).add(t as usize * weights.nb[2] + k as usize * weights.nb[1]) as *const f32))
                };
                if e < 0 {
                    fatal(&format!("layer {}: router selected expert {e}", op.layer));
                }
                rows.push((e as u32, w));
            }
        }
        let rt = runtime::get().unwrap_or_else(|| fatal("routing recorded without an sdq runtime"));
        rt.record_routing(op.layer, op.starts_step, n_tokens as usize, n_used as usize, rows);
    })
}

/// Predictions made but not yet acted on, by the layer that made them:
/// (next layer, experts best first).
type Predictions = Mutex<HashMap<u32, (u32, Vec<u32>)>>;

pub(super) fn predictions() -> &'static Predictions {
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
    guard("the expert prediction", || {
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
    })
}
