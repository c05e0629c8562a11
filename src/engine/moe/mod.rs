//! Expert compute: the ggml custom ops that replace a paged layer's expert
//! matmuls. `paged_moe_experts` takes a whole layer with SwiGLU (gate, up,
//! SwiGLU and down per expert, so a batch pins and reads each expert once);
//! `paged_mul_mat_id` replaces one `ggml_mul_mat_id` for any other layer.
//! Both multiply exactly as ggml's CPU mul_mat_id does for the weight's
//! layout in stock llama.cpp with the same flags: the batch's activations
//! converted once to the weight's `vec_dot_type`, then per expert, for a
//! weight stock repacks (the reader converted it into that layout), the
//! repacked GEMV over the weight-row ranges of stock's threads; for a plain
//! one, ggml's tiled kernel where stock takes it (8 or more rows of a tiled
//! type) and one `vec_dot` per value elsewhere. So results match stock's bit
//! for bit, with the weights from pinned arena slots.
//!
//! Work is split by expert, claimed dynamically: each of ggml's threads takes
//! the next expert nobody has taken, preferring one already in the arena
//! (of those, the one with the most uses, so that a call ends on small
//! ones), pins it, computes all of its tokens and releases it at once. In a layer's
//! first op the first thread to arrive hands all of the batch's misses to
//! the pager's readers at once (`Pager::prepare`), so they are read in
//! parallel while resident experts are computed, and each missing expert is
//! computed as soon as it is read. Each output value belongs to one (token,
//! slot) pair, so threads never write the same memory and no reduction is
//! needed: which thread computes an expert, and when, does not change a bit
//! of the result. The router-weighted sum is llama.cpp's own ops, in its own
//! order.
//!
//! In a prompt group whose ubatches share their expert ops (`shared`), the
//! first ubatch's op computes every ubatch's experts of the layer, each
//! ubatch's from its own input into its own output, so each expert is
//! pinned once per group.
//!
//! While decoding, the next layer's experts are predicted from this layer's
//! expert input (`predict_next`: the next layer's router applied to it) and
//! read ahead at low priority once this layer's own misses are submitted.
//!
//! These are FFI entry points (ggml calls them on its worker threads): tensor
//! access here is raw, with each block's invariant stated.

use crate::engine::ffi::ggml::{DotKernels, WeightLayout};
use crate::engine::ffi::sys;
use crate::engine::pager::layout::Part;
use crate::engine::pager::{Count, Pager, PinnedExpert};
use crate::engine::runtime;
use crate::engine::runtime::failure::{self, fatal, guard};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_void};

use std::sync::{Arc, Mutex, OnceLock};

mod activations;
mod routing;
mod shared;

use activations::Activations;
use routing::predictions;
pub use routing::{predict_next, record_routing, Predictor, RoutingRecord};
pub use shared::{fused_layers_built, group_ends, group_layer, note_fused_layer};

/// Batches of up to this many tokens are decode steps (of one sequence or
/// several at once), whose prediction of the next layer is read ahead only
/// while predictions pay; a larger one is a prompt's.
const DECODE_MAX_TOKENS: i64 = 8;

/// What one paged matmul needs, fixed when the graph is built (graphs are
/// reused, so this lives as long as the process).
#[derive(Debug)]
pub struct PagedMatmul {
    pub name: String,
    pub layer: u32,
    pub part: Part,
    pub kernels: DotKernels,
    /// The weight's layout in the arena (stock's: plain or repacked).
    pub layout: WeightLayout,
    /// True for the first paged layer's first matmul (gate or gate_up): it
    /// counts the step's tokens and starts its paged work.
    pub starts_step: bool,
    /// True for the last paged layer's down: the step's paged work ends.
    pub ends_step: bool,
}

/// What one layer's fused expert op (gate, up, SwiGLU and down per expert)
/// needs, fixed when the graph is built.
#[derive(Debug)]
pub struct PagedExperts {
    /// The layer's down tensor, for messages.
    pub name: String,
    pub layer: u32,
    pub gate: DotKernels,
    pub up: DotKernels,
    pub down: DotKernels,
    /// The layouts of gate, up and down in the arena (stock's).
    pub layouts: [WeightLayout; 3],
    /// True for the first paged layer: it counts tokens, and a step's paged
    /// work starts.
    pub counts_tokens: bool,
    /// True for the last paged layer: a step's paged work ends.
    pub ends_step: bool,
}

/// The (slot k, token t) pairs one expert serves, flattened as ggml's
/// mul_mat_id row table (`[k0, t0, k1, t1, …]`), which the tiled kernel reads.
type Uses = Vec<i32>;

/// What every thread of one call shares, fixed when the call starts.
struct Batch {
    /// The batch's experts in ascending order, with their uses by each of
    /// its inputs (one, or a shared layer's every ubatch).
    experts: Vec<(u32, Vec<Uses>)>,
    inputs: Vec<BatchInput>,
}

/// One input of a call: its activations, converted, and where its output
/// goes (its op's output, or a later ubatch's kept aside).
struct BatchInput {
    acts: Activations,
    /// The output's address and its strides between uses and tokens.
    out: usize,
    nb1: usize,
    nb2: usize,
}

/// One input of a call as its op gives it: routing [n_used, n_tokens], the
/// F32 input, and where its output goes.
struct Input<'a> {
    ids: &'a sys::ggml_tensor,
    b: &'a sys::ggml_tensor,
    out: *mut u8,
    nb1: usize,
    nb2: usize,
}

/// One call of a paged matmul (one graph node, all of ggml's threads): the
/// batch and which of its experts are taken. The first thread to arrive
/// creates it, the last to leave removes it; ggml does not start the node
/// again before every thread has left it.
struct Call {
    batch: Arc<Batch>,
    taken: Vec<bool>,
    /// Every expert before this index is taken.
    first_open: usize,
    /// The experts' indices, the most uses first: of the experts ready, a
    /// thread takes the largest, so that the call ends on small ones rather
    /// than one thread computing a popular expert while the others wait
    /// for it at ggml's barrier.
    by_work: Vec<usize>,
    /// Misses `prepare` found no slot for: their acquire reads them.
    deferred: HashSet<u32>,
    left: usize,
    /// Threads between joining the call and leaving it: none, with some
    /// never left, is a call a failed graph left (see `forget_left_calls`).
    inside: usize,
}

/// A thread's part in a call, from `join` until it leaves: a thread that
/// unwinds out of the op (a panic, or an error inside a host program) is
/// counted out when this drops, so that the call goes with its last thread.
struct Participant {
    key: usize,
    nth: usize,
    left: bool,
}

impl Drop for Participant {
    fn drop(&mut self) {
        if !self.left {
            let mut calls = calls().lock().unwrap_or_else(|p| p.into_inner());
            leave(&mut calls, self.key, self.nth);
        }
    }
}

/// This thread leaves call `key`: the last of its `nth` threads removes it.
fn leave(calls: &mut HashMap<usize, Call>, key: usize, nth: usize) {
    if let Some(call) = calls.get_mut(&key) {
        call.left += 1;
        call.inside = call.inside.saturating_sub(1);
        if call.left >= nth {
            calls.remove(&key);
        }
    }
}

fn calls() -> &'static Mutex<HashMap<usize, Call>> {
    static CALLS: OnceLock<Mutex<HashMap<usize, Call>>> = OnceLock::new();
    CALLS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Forgets the predictions of the next layers' experts not used yet (their
/// model was freed: a later model's layers have the same numbers).
pub fn forget_predictions() {
    predictions().lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// Forgets the calls a failed graph left (called before a context's next
/// ubatch): one whose threads have all left but one that never joined,
/// which the next graph's op at the same address must not join. Not a call
/// some thread is inside: another context's, computing on another thread
/// of a host program.
pub fn forget_left_calls() {
    let mut calls = calls().lock().unwrap_or_else(|p| p.into_inner());
    let before = calls.len();
    calls.retain(|_, c| c.inside > 0);
    if calls.len() < before {
        log::debug!("{} expert op call(s) of a failed graph forgotten", before - calls.len());
    }
}

/// Weight rows multiplied with every use before the next rows: 16 rows of a
/// 2048-wide Q4_K expert are 18 KiB, which stays in L1.
const ROW_BLOCK: usize = 16;

/// Uses of one expert the fused op multiplies at a time. ggml's tiled
/// kernel takes an expert's routed rows in windows of 256 (TILED_TILE_K),
/// so cutting the rows at multiples of 256 gives every value the window
/// stock gives it; the other kernels compute each row alone.
const FUSED_ROWS: usize = 256;

/// The tiled kernel's per-thread workspace, 64-byte aligned.
struct Scratch {
    buf: Vec<u8>,
}

impl Scratch {
    fn get(&mut self, bytes: usize) -> *mut u8 {
        if self.buf.len() < bytes + 64 {
            self.buf = vec![0; bytes + 64];
        }
        let p = self.buf.as_mut_ptr();
        // SAFETY: the offset is under 64 and the buffer has 64 bytes of slack.
        unsafe { p.add(p.align_offset(64)) }
    }
}

/// One thread's buffers for the fused op: one expert's routed rows and its
/// intermediate products, reused from expert to expert.
#[derive(Default)]
struct Fused {
    /// (use j, token t) pairs for gate and up, then (j, j) for down.
    rows: Vec<i32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// SwiGLU of gate and up, then converted to down's activation type.
    act: Vec<f32>,
    act_q: Vec<u8>,
    out: Vec<f32>,
}

struct Workspace {
    tiled: Scratch,
    fused: Fused,
}

thread_local! {
    static WORKSPACE: RefCell<Workspace> = RefCell::new(Workspace { tiled: Scratch { buf: Vec::new() }, fused: Fused::default() });
}

/// One expert's product with its routed rows: for each pair (k, t) of
/// `rows`, weight · activation row t·b_ne1 + k mod b_ne1 of `acts` is
/// written at `out` + k·nb1 + t·nb2 (bytes), with the kernel stock uses for
/// the weight: for a repacked one, the repacked GEMV over the column ranges
/// of stock's `nth` threads; else ggml's tiled kernel where stock would take
/// it, else one vec_dot per value.
struct ExpertMatmul<'a> {
    kernels: &'a DotKernels,
    /// The paged weight tensor (type, rows, columns).
    weight: &'a sys::ggml_tensor,
    layout: WeightLayout,
    /// sdq_expert_tiled_scratch for it: 0 when the tiled kernel cannot take it.
    tiled_bytes: usize,
    /// ggml's threads for this op: stock's repacked kernel splits an
    /// expert's rows by them.
    nth: usize,
}

impl<'a> ExpertMatmul<'a> {
    fn new(kernels: &'a DotKernels, weight: &'a sys::ggml_tensor, layout: WeightLayout, nth: usize) -> ExpertMatmul<'a> {
        // Stock never gives a repacked weight to the tiled kernel.
        let tiled_bytes = match layout {
            // SAFETY: weight is a valid tensor; the call only reads its type and shape.
            WeightLayout::Plain => unsafe { sys::sdq_expert_tiled_scratch(weight) },
            WeightLayout::Repacked(_) => 0,
        };
        ExpertMatmul { kernels, weight, layout, tiled_bytes, nth }
    }

    /// # Safety
    /// `data` must be one expert of the weight (rows × row bytes); `acts`
    /// whole rows of the activation type for the weight's columns, holding
    /// every row a pair names; for every pair, the weight's row count of
    /// floats at out + k·nb1 + t·nb2 must be writable and written by no one
    /// else meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(&self, data: &[u8], acts: &[u8], b_ne1: usize, rows: &[i32], out: *mut u8, nb1: usize, nb2: usize, scratch: &mut Scratch) {
        if let WeightLayout::Repacked(r) = self.layout {
            let act_bytes = self.kernels.activation_row_bytes(self.weight.ne[0] as usize);
            // SAFETY: per this function's contract; the reader converted the
            // expert into this layout before publishing it.
            unsafe { r.mul(data, b_ne1, acts, act_bytes, rows, out, nb1, nb2, self.nth) };
            return;
        }
        let tiled = self.tiled_bytes > 0
            // SAFETY: per this function's contract; the scratch holds
            // tiled_bytes, 64-byte aligned.
            && unsafe {
                sys::sdq_expert_tiled(
                    self.weight,
                    data.as_ptr().cast(),
                    b_ne1 as i64,
                    acts.as_ptr().cast(),
                    acts.len(),
                    (rows.len() / 2) as i64,
                    rows.as_ptr(),
                    out.cast(),
                    nb1,
                    nb2,
                    scratch.get(self.tiled_bytes).cast(),
                )
            };
        if tiled {
            return;
        }
        let (cols, n_rows) = (self.weight.ne[0] as usize, self.weight.ne[1] as usize);
        let row_bytes = data.len() / n_rows;
        let act_bytes = self.kernels.activation_row_bytes(cols);
        // A block of weight rows stays in cache while every use of the
        // expert is multiplied with it: the weights are streamed from memory
        // once per batch, not once per token. Each value is still one
        // vec_dot of one row and one activation, as stock computes it.
        for first in (0..n_rows).step_by(ROW_BLOCK) {
            let block = first..(first + ROW_BLOCK).min(n_rows);
            for kt in rows.chunks_exact(2) {
                let (k, t) = (kt[0] as usize, kt[1] as usize);
                let a = t * b_ne1 + k % b_ne1;
                let act = &acts[a * act_bytes..(a + 1) * act_bytes];
                // SAFETY: per this function's contract.
                let out = unsafe { std::slice::from_raw_parts_mut(out.add(k * nb1 + t * nb2) as *mut f32, n_rows) };
                for r in block.clone() {
                    out[r] = self.kernels.dot(cols, &data[r * row_bytes..(r + 1) * row_bytes], act);
                }
            }
        }
    }
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
    guard("the paged expert matmul", || {
        // SAFETY: per this function's contract, dst and its sources are valid
        // tensors whose data ggml allocated for this graph, and userdata is a
        // PagedMatmul that is never freed.
        unsafe { compute(&mut *dst, ith as usize, nth as usize, &*(userdata as *const PagedMatmul)) }
    })
}

/// # Safety
/// As for `paged_mul_mat_id`.
unsafe fn compute(dst: &mut sys::ggml_tensor, ith: usize, nth: usize, op: &PagedMatmul) {
    // SAFETY: src[0..3] were set by ggml_custom_4d from the hook's arguments.
    let (w, b, ids) = unsafe { (&*dst.src[0], &*dst.src[1], &*dst.src[2]) };
    let rt = runtime::get().unwrap_or_else(|| fatal("paged expert matmul without an sdq runtime"));
    let Some(pager) = rt.pager_if_ready(ids.ne[0] as usize, (op.starts_step && ith == 0).then_some(ids.ne[1] as u64)) else {
        // SAFETY: dst is this op's output.
        return unsafe { leave_out(dst, ith, nth, op.layer) };
    };
    let key = dst as *const sys::ggml_tensor as usize;
    // ggml runs a layer's gate (or fused gate_up) matmul first: it is
    // SwiGLU's first source, and it starts the batch's reads.
    let starts_layer = matches!(op.part, Part::Gate | Part::GateUp);
    let starts = || {
        if op.starts_step {
            start_step(rt, pager, ids.ne[1] as u64);
        }
    };
    let input = Input { ids, b, out: dst.data.cast(), nb1: dst.nb[1], nb2: dst.nb[2] };
    // SAFETY: ids is the I32 [n_used, n_tokens] routing of this call and b
    // its F32 input with contiguous rows (checked when the op was built).
    let (batch, me) = unsafe { join(key, op.layer, &op.name, starts_layer, false, starts, &op.kernels, &[input], pager, nth) };
    let matmul = ExpertMatmul::new(&op.kernels, w, op.layout, nth);
    WORKSPACE.with_borrow_mut(|ws| {
        for_each_pinned(me, op.layer, pager, &batch, |expert, uses| {
            // SAFETY: the part is this expert's rows; the activations are b
            // converted (by join's caller) in stock's layout; dst is F32
            // [rows, n_used, n_tokens], whose rows (k, t) of expert e belong
            // to e alone, and e to this thread alone.
            unsafe {
                matmul.run(expert.part(op.part), &batch.inputs[0].acts.buf, b.ne[1] as usize, &uses[0], dst.data.cast(), dst.nb[1], dst.nb[2], &mut ws.tiled)
            };
        });
    });
    if op.ends_step && ith == 0 {
        end_step(rt, pager);
    }
}

/// The fused op: dst[:, k, t] = down_e · swiglu(gate_e · b_t, up_e · b_t)
/// with e = ids[k, t], computed expert by expert, so that each selected
/// expert is pinned (and, on a miss, read) once per batch for all three of
/// its matrices. Each product and the SwiGLU are ggml's own kernels on the
/// same rows stock multiplies, so every value is stock's to the bit.
///
/// # Safety
/// Called by ggml with `dst` built by `hooks::moe_experts` (src = gate, up,
/// down, b, ids) and `userdata` pointing at a leaked `PagedExperts`.
pub unsafe extern "C" fn paged_moe_experts(dst: *mut sys::ggml_tensor, ith: c_int, nth: c_int, userdata: *mut c_void) {
    guard("the paged expert layer", || {
        // SAFETY: per this function's contract.
        unsafe { compute_fused(&mut *dst, ith as usize, nth as usize, &*(userdata as *const PagedExperts)) }
    })
}

/// # Safety
/// As for `paged_moe_experts`.
unsafe fn compute_fused(dst: &mut sys::ggml_tensor, ith: usize, nth: usize, op: &PagedExperts) {
    // SAFETY: src[0..5] were set by ggml_custom_4d from the hook's arguments.
    let (gate_w, up_w, down_w, b, ids) = unsafe { (&*dst.src[0], &*dst.src[1], &*dst.src[2], &*dst.src[3], &*dst.src[4]) };
    let (n_ff, n_embd) = (gate_w.ne[1] as usize, down_w.ne[1] as usize);
    let rt = runtime::get().unwrap_or_else(|| fatal("paged expert layer without an sdq runtime"));
    let Some(pager) = rt.pager_if_ready(ids.ne[0] as usize, (op.counts_tokens && ith == 0).then_some(ids.ne[1] as u64)) else {
        // SAFETY: dst is this op's output.
        return unsafe { leave_out(dst, ith, nth, op.layer) };
    };
    let key = dst as *const sys::ggml_tensor as usize;
    let starts = || {
        if op.counts_tokens {
            start_step(rt, pager, ids.ne[1] as u64);
        }
    };
    // SAFETY: dst is a fused expert op being computed.
    let kept = match unsafe { shared::role(dst) } {
        shared::Role::Alone => Vec::new(),
        shared::Role::First(kept) => kept,
        shared::Role::Copy(out, len) => {
            // A later ubatch of a group whose first ubatch's op computed
            // this layer for it: its step still starts and ends here.
            if op.counts_tokens && ith == 0 {
                start_step(rt, pager, ids.ne[1] as u64);
            }
            // SAFETY: out is this op's output as computed for it, len bytes,
            // which is dst's size; each thread copies its own chunk.
            unsafe { copy_out(dst, out, len, ith, nth) };
            if op.ends_step && ith == 0 {
                end_step(rt, pager);
            }
            return;
        }
    };
    let mut inputs = vec![Input { ids, b, out: dst.data.cast(), nb1: dst.nb[1], nb2: dst.nb[2] }];
    inputs.extend(kept.iter().map(|k| Input { ids: &k.routing, b: &k.input, out: k.out, nb1: k.nb1, nb2: k.nb2 }));
    // SAFETY: each ids is the I32 [n_used, n_tokens] routing and b the F32
    // [n_embd, 1, n_tokens] input of a ubatch's op, contiguous (checked when
    // the op was built), a later ubatch's where it keeps them aside; each
    // out is F32 [n_embd, n_used, n_tokens] with the strides given.
    let (batch, me) = unsafe { join(key, op.layer, &op.name, true, !kept.is_empty(), starts, &op.gate, &inputs, pager, nth) };
    let [gate_l, up_l, down_l] = op.layouts;
    let (gate, up, down) =
        (ExpertMatmul::new(&op.gate, gate_w, gate_l, nth), ExpertMatmul::new(&op.up, up_w, up_l, nth), ExpertMatmul::new(&op.down, down_w, down_l, nth));
    let down_act_bytes = op.down.activation_row_bytes(n_ff);
    WORKSPACE.with_borrow_mut(|ws| {
        let Workspace { tiled, fused: f } = ws;
        for_each_pinned(me, op.layer, pager, &batch, |expert, by_input| {
            for (input, uses) in batch.inputs.iter().zip(by_input) {
                // At most FUSED_ROWS uses at a time: this thread's buffers stay
                // the same size whatever the ubatch (an expert a whole ubatch
                // routes to would otherwise take ubatch × n_ff floats thrice).
                for uses in uses.chunks(2 * FUSED_ROWS) {
                    let n = uses.len() / 2;
                    f.gate.resize(n * n_ff, 0.0);
                    f.up.resize(n * n_ff, 0.0);
                    f.act.resize(n * n_ff, 0.0);
                    f.act_q.resize(n * down_act_bytes, 0);
                    f.out.resize(n * n_embd, 0.0);
                    // Use j of token t: gate and up read b's row t and write row j.
                    f.rows.clear();
                    f.rows.extend(uses.chunks_exact(2).enumerate().flat_map(|(j, kt)| [j as i32, kt[1]]));
                    // SAFETY: the parts are this expert's rows; b's rows are converted
                    // for gate and up (which share an activation type, checked when
                    // the op was built); row j of gate and up (n_ff floats at j ·
                    // n_ff · 4) is this thread's buffer.
                    unsafe {
                        gate.run(expert.part(Part::Gate), &input.acts.buf, 1, &f.rows, f.gate.as_mut_ptr().cast(), n_ff * 4, 0, tiled);
                        up.run(expert.part(Part::Up), &input.acts.buf, 1, &f.rows, f.up.as_mut_ptr().cast(), n_ff * 4, 0, tiled);
                    }
                    for ((act, g), u) in f.act.chunks_exact_mut(n_ff).zip(f.gate.chunks_exact(n_ff)).zip(f.up.chunks_exact(n_ff)) {
                        // SAFETY: three distinct buffers of n_ff floats.
                        unsafe { sys::sdq_swiglu(n_ff as i32, act.as_mut_ptr(), g.as_ptr(), u.as_ptr()) };
                    }
                    for (act, q) in f.act.chunks_exact(n_ff).zip(f.act_q.chunks_exact_mut(down_act_bytes)) {
                        op.down.convert_activation(act, q);
                    }
                    // Down reads activation row j and writes row j.
                    f.rows.clear();
                    f.rows.extend((0..n as i32).flat_map(|j| [j, j]));
                    // SAFETY: as above, with down's rows and activations.
                    unsafe { down.run(expert.part(Part::Down), &f.act_q, 1, &f.rows, f.out.as_mut_ptr().cast(), n_embd * 4, 0, tiled) };
                    for (out, kt) in f.out.chunks_exact(n_embd).zip(uses.chunks_exact(2)) {
                        // SAFETY: the input's output is F32 [n_embd, n_used,
                        // n_tokens] with its strides (dst, or a later ubatch's
                        // kept aside); its row (k, t) belongs to expert e alone,
                        // and e to this thread alone.
                        let row = unsafe {
                            let p = (input.out as *mut u8).add(kt[1] as usize * input.nb2 + kt[0] as usize * input.nb1);
                            std::slice::from_raw_parts_mut(p as *mut f32, n_embd)
                        };
                        row.copy_from_slice(out);
                    }
                }
            }
        });
    });
    if op.ends_step && ith == 0 {
        end_step(rt, pager);
    }
}

/// Copies this thread's share of `len` bytes at `out` into `dst`.
///
/// # Safety
/// `dst` must be a contiguous tensor of `len` bytes, and `out` readable for
/// `len` bytes, written by no one meanwhile.
unsafe fn copy_out(dst: &mut sys::ggml_tensor, out: *const u8, len: usize, ith: usize, nth: usize) {
    // SAFETY: per this function's contract.
    unsafe {
        if sys::ggml_nbytes(dst) != len {
            fatal("a shared expert op's output differs in size from its ubatch's");
        }
        let share = thread_share(len, ith, nth);
        std::ptr::copy_nonoverlapping(out.add(share.start), (dst.data as *mut u8).add(share.start), share.len());
    }
}

/// Thread `ith` of `nth`'s share of `bytes` bytes written by all of them.
fn thread_share(bytes: usize, ith: usize, nth: usize) -> std::ops::Range<usize> {
    let chunk = bytes.div_ceil(nth);
    let start = (ith * chunk).min(bytes);
    start..(start + chunk).min(bytes)
}

/// A ubatch of `n_tokens` reaches the first paged layer: a step starts,
/// unless it is a later ubatch of a group whose step has (see
/// `runtime::groups`).
fn start_step(rt: &runtime::Runtime, pager: &Pager, n_tokens: u64) {
    if let Some(tokens) = rt.step_starts(n_tokens) {
        rt.count_tokens(tokens);
        pager.step_started();
    }
}

/// A ubatch leaves the last paged layer: its step ends, unless a later
/// ubatch of its group is still to.
fn end_step(rt: &runtime::Runtime, pager: &Pager) {
    if rt.step_ends() {
        pager.step_ended();
        rt.step_ended();
    }
}

/// What `ggml_custom_4d` keeps in a node's `op_params` (ggml-impl.h's
/// `ggml_custom_op_params`): the function and its userdata.
#[repr(C)]
struct CustomOpParams {
    fun: sys::ggml_custom_op_t,
    n_tasks: c_int,
    userdata: *mut c_void,
}

/// Whether graph node `node` is sdq's op for a whole layer's experts.
///
/// # Safety
/// `node` must be a valid tensor of a graph.
unsafe fn is_fused(node: &sys::ggml_tensor) -> bool {
    // SAFETY: per this function's contract.
    unsafe { custom_op(node) }.is_some_and(|(fun, _)| fun == paged_moe_experts as *const () as usize)
}

/// A custom op node's function (as an address) and userdata, or None for
/// any other node.
///
/// # Safety
/// `node` must be a valid tensor of a graph.
unsafe fn custom_op(node: &sys::ggml_tensor) -> Option<(usize, *mut c_void)> {
    if node.op != sys::GGML_OP_CUSTOM {
        return None;
    }
    // SAFETY: a GGML_OP_CUSTOM node's op_params start with ggml's
    // ggml_custom_op_params (op_params is 64 bytes, aligned for pointers).
    let params = unsafe { &*(node.op_params.as_ptr() as *const CustomOpParams) };
    Some((params.fun? as usize, params.userdata))
}

/// sdq's expert op that graph node `node` is, if it is one: its layer and
/// its routing (the ids tensor).
///
/// # Safety
/// `node` must be a valid tensor of a graph.
unsafe fn expert_op(node: &sys::ggml_tensor) -> Option<(u32, &sys::ggml_tensor)> {
    // SAFETY: per this function's contract.
    let (fun, userdata) = unsafe { custom_op(node) }?;
    // SAFETY: sdq's ops were built with these userdata (hooks::mul_mat_id,
    // hooks::moe_experts), leaked for the process's lifetime, and sources
    // 2 (matmul) and 4 (fused) are their ids.
    unsafe {
        if fun == paged_moe_experts as *const () as usize {
            Some(((*(userdata as *const PagedExperts)).layer, &*node.src[4]))
        } else if fun == paged_mul_mat_id as *const () as usize {
            Some(((*(userdata as *const PagedMatmul)).layer, &*node.src[2]))
        } else {
            None
        }
    }
}

/// The paged layer whose experts graph node `node` computes, or None. A
/// prompt group's graphs are cut with this before their first expert op
/// runs, so its top-k is noted for the runtime (`Runtime::staged_top_k`),
/// which may need the pager before that op asks for it.
///
/// # Safety
/// `node` must be a valid tensor of a graph.
pub unsafe fn expert_layer(node: &sys::ggml_tensor) -> Option<u32> {
    // SAFETY: per this function's contract.
    let (layer, ids) = unsafe { expert_op(node) }?;
    if let Some(rt) = runtime::get() {
        rt.staged_top_k(ids.ne[0] as usize);
    }
    Some(layer)
}

/// Expert op `node`'s routing is computed, and it runs after the other
/// ubatches of its group have had their turn: its experts are read now, at
/// low priority, into slots that hold neither its layer's experts nor the
/// layer before's (which the group's other ubatches are still to use), and
/// kept as the group's routes at its layer (`Pager::group_routes`).
///
/// # Safety
/// `node` must be a valid tensor of a graph, its sources computed.
pub unsafe fn read_ahead(node: &sys::ggml_tensor) {
    // SAFETY: per this function's contract.
    let Some((layer, ids)) = (unsafe { expert_op(node) }) else { return };
    let Some(rt) = runtime::get() else { return };
    let Some(pager) = rt.pager_ready() else { return };
    let mut experts = std::collections::BTreeSet::new();
    for t in 0..ids.ne[1] {
        for k in 0..ids.ne[0] {
            // SAFETY: k < ne0 and t < ne1 of ids, the I32 routing computed.
            let e = unsafe { expert_id(ids, k, t) };
            if e >= 0 {
                experts.insert(e as u32);
            }
        }
    }
    let before = pager.layout().layers.range(..layer).next_back().map_or(layer, |(&l, _)| l);
    let experts: Vec<u32> = experts.into_iter().collect();
    pager.group_routes(layer, (before != layer).then_some(before), &experts);
    pager.read_ahead(layer, &experts, before);
}

/// Writes this thread's share of `dst` as zeros: the experts' output of a
/// batch computed without the pager (`Runtime::pager_if_ready`: the target's
/// warm-up before its draft model loads, whose result the tool drops, or a
/// host program's batch that fails because the arena cannot be planned,
/// whose output is never used), with the layer's prediction dropped too.
///
/// # Safety
/// `dst` must be this op's output: a contiguous tensor ggml allocated.
unsafe fn leave_out(dst: &mut sys::ggml_tensor, ith: usize, nth: usize, layer: u32) {
    if ith == 0 {
        predictions().lock().unwrap_or_else(|p| p.into_inner()).remove(&layer);
    }
    // SAFETY: dst is contiguous (a custom op's output), so its bytes are
    // ggml_nbytes from data; each thread writes its own chunk.
    unsafe {
        let share = thread_share(sys::ggml_nbytes(dst), ith, nth);
        std::ptr::write_bytes((dst.data as *mut u8).add(share.start), 0, share.len());
    }
}

/// This thread's view of call `key`, which the first thread to arrive
/// creates: it starts the step where the call does (`starts`), groups the
/// routing of its `inputs` by expert and, for the layer's first op
/// (`starts_layer`), hands the batch's misses to the readers and starts the
/// prefetch (`whole_group`: the inputs are a prompt group's every ubatch,
/// its expert ops shared). Returns once every input's `b` is converted to
/// `kernels`' activation type, which every thread of the call helps with,
/// with this thread's part in the call (one of `nth`).
///
/// # Safety
/// Each input's `ids` must be a valid I32 routing tensor of the call and
/// its `b` the F32 input [cols, ne11, n_tokens] with contiguous rows.
#[allow(clippy::too_many_arguments)]
unsafe fn join(
    key: usize,
    layer: u32,
    name: &str,
    starts_layer: bool,
    whole_group: bool,
    starts: impl FnOnce(),
    kernels: &DotKernels,
    inputs: &[Input<'_>],
    pager: &Pager,
    nth: usize,
) -> (Arc<Batch>, Participant) {
    let mut calls = calls().lock().unwrap_or_else(|p| p.into_inner());
    let call = calls.entry(key).or_insert_with(|| {
        // The step's clock starts before its first lookups are counted,
        // whichever thread arrives first.
        starts();
        let mut by_expert: BTreeMap<i32, Vec<Uses>> = BTreeMap::new();
        for (i, input) in inputs.iter().enumerate() {
            let ids = input.ids;
            for t in 0..ids.ne[1] {
                for k in 0..ids.ne[0] {
                    // SAFETY: k < ne0 and t < ne1 of ids (this function's contract).
                    let e = unsafe { expert_id(ids, k, t) };
                    by_expert.entry(e).or_insert_with(|| vec![Uses::new(); inputs.len()])[i].extend([k as i32, t as i32]);
                }
            }
        }
        if let Some((&e, _)) = by_expert.iter().find(|(&e, _)| e < 0) {
            fatal(&format!("{name}: router selected expert {e}"));
        }
        let (ids, n_tokens) = (inputs[0].ids, inputs[0].ids.ne[1]);
        let deferred = if starts_layer {
            let experts: Vec<u32> = by_expert.keys().map(|&e| e as u32).collect();
            if n_tokens > 1 {
                runtime::get().inspect(|rt| rt.prompt_touched(layer, &experts));
            }
            if whole_group {
                log::debug!("layer {layer}: the experts of {} ubatches in one op", inputs.len());
                runtime::get().inspect(|rt| rt.on_layer_shared());
            }
            let deferred: HashSet<u32> = pager.prepare(layer, &experts, whole_group).unwrap_or_else(|err| fatal(&err.to_string())).into_iter().collect();
            // In a prompt group, what the later ubatches need at this layer
            // is read while this one computes; not where the arena already
            // had no slot for this ubatch's own misses, nor where this op
            // computes the later ubatches too.
            if n_tokens > DECODE_MAX_TOKENS && deferred.is_empty() && !whole_group {
                pager.read_group_owed(layer);
            }
            // This layer's misses are queued: now what the next layer will
            // likely need. A prompt batch's prediction (the union of its
            // tokens') is nearly what the next layer touches, and is read
            // while this layer computes; a decode step's, only while
            // predictions pay.
            let predicted = predictions().lock().unwrap_or_else(|p| p.into_inner()).remove(&layer);
            if let Some((next, predicted)) = predicted {
                if n_tokens > DECODE_MAX_TOKENS {
                    pager.read_ahead(next, &predicted, layer);
                } else {
                    // Judged whether read or not: the gate learns while closed.
                    pager.predicted(next, &predicted);
                    if runtime::get().is_some_and(|rt| rt.prefetch_worthwhile(pager, ids.ne[0] as usize)) {
                        pager.prefetch(next, &predicted, layer);
                    }
                }
            }
            deferred
        } else {
            HashSet::new()
        };
        let experts: Vec<(u32, Vec<Uses>)> = by_expert.into_iter().map(|(e, u)| (e as u32, u)).collect();
        let inputs = inputs
            .iter()
            .map(|i| BatchInput {
                acts: Activations::new(kernels.activation_row_bytes(i.b.ne[0] as usize), (i.b.ne[1] * i.b.ne[2]) as usize),
                out: i.out as usize,
                nb1: i.nb1,
                nb2: i.nb2,
            })
            .collect();
        let mut by_work: Vec<usize> = (0..experts.len()).collect();
        by_work.sort_by_key(|&i| std::cmp::Reverse(experts[i].1.iter().map(Vec::len).sum::<usize>()));
        Call { taken: vec![false; experts.len()], batch: Arc::new(Batch { experts, inputs }), first_open: 0, by_work, deferred, left: 0, inside: 0 }
    });
    call.inside += 1;
    let batch = Arc::clone(&call.batch);
    drop(calls);
    let me = Participant { key, nth, left: false };
    for (input, converted) in inputs.iter().zip(&batch.inputs) {
        // SAFETY: b is the input the buffer was sized from (this function's contract).
        unsafe { converted.acts.convert(input.b, kernels) };
    }
    (batch, me)
}

/// Computes this thread's share of a call: claims the batch's experts one at
/// a time (`next_expert`), pins each (reading it on a miss) for `work` with
/// its uses, and releases its slot as soon as `work` is done with it. A
/// failed acquire abandons the batch (or ends the process): that expert's
/// rows of dst are never read, and the loop goes on so that every claim is
/// drained and the call's last thread removes it.
fn for_each_pinned(mut me: Participant, layer: u32, pager: &Pager, batch: &Batch, mut work: impl FnMut(&PinnedExpert<'_>, &[Uses])) {
    while let Some((i, count)) = next_expert(&mut me, layer, pager) {
        let (e, uses) = (batch.experts[i].0, &batch.experts[i].1);
        match pager.acquire(layer, e, count) {
            Ok(expert) => work(&expert, uses),
            Err(err) => failure::fail_batch(&err.to_string()),
        }
    }
}

/// The index of the next expert of call `key` for this thread to compute
/// (preferring one already in the arena), and how its acquire counts; None
/// when every expert is taken (and this thread leaves the call).
fn next_expert(me: &mut Participant, layer: u32, pager: &Pager) -> Option<(usize, Count)> {
    let mut calls = calls().lock().unwrap_or_else(|p| p.into_inner());
    let call = calls.get_mut(&me.key).unwrap_or_else(|| fatal("paged matmul call left before its threads"));
    while call.first_open < call.taken.len() && call.taken[call.first_open] {
        call.first_open += 1;
    }
    let experts = &call.batch.experts;
    let open = || (call.first_open..experts.len()).filter(|&i| !call.taken[i]);
    // Resident experts first, the one with the most uses first; then those
    // being read (waiting for a read in flight), and only then the misses
    // prepare found no slot for: reading one of those needs a victim, which
    // should be an expert this batch has finished with, not one it has yet
    // to use.
    let pick = pager
        .first_ready(layer, call.by_work.iter().copied().filter(|&i| !call.taken[i]).map(|i| (i, experts[i].0)))
        .or_else(|| open().find(|&i| !call.deferred.contains(&experts[i].0)))
        .or_else(|| open().next());
    match pick {
        Some(i) => {
            call.taken[i] = true;
            let count = if call.deferred.contains(&experts[i].0) { Count::Nothing } else { Count::Later };
            Some((i, count))
        }
        None => {
            leave(&mut calls, me.key, me.nth);
            me.left = true;
            None
        }
    }
}
