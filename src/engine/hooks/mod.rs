//! The FFI boundary with the patched llama.cpp: the hook table of
//! `shim/sdq-hooks.h`, filled with trampolines into the runtime. Every
//! trampoline runs inside `catch_unwind`, so nothing unwinds into C++.

use crate::engine::ffi::ggml::{DotKernels, GgmlType, WeightLayout};
use crate::engine::ffi::{llama, sys};
use crate::engine::moe::{self, PagedExperts, PagedMatmul, Predictor, RoutingRecord};
use crate::engine::pager::layout::{PagedTensor, Part};
use crate::engine::runtime;
use crate::engine::runtime::failure::{self, fatal, guard, guard_load, guard_or, During, Fallback};
use crate::engine::runtime::phases::ContextSize;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

pub mod buffer_type;
mod rpc;

struct HookTable(sys::sdq_hooks);

// SAFETY: the table is written once and then only read (by llama.cpp).
unsafe impl Send for HookTable {}
// SAFETY: as above.
unsafe impl Sync for HookTable {}

static HOOKS: OnceLock<HookTable> = OnceLock::new();

/// Installs sdq's hooks into llama.cpp: from now on, routed-expert weights of
/// models loaded in this process are paged. Needs the runtime installed first.
pub fn install() {
    assert!(runtime::get().is_some(), "hooks need the runtime");
    let table = HOOKS.get_or_init(|| {
        HookTable(sys::sdq_hooks {
            version: sys::SDQ_HOOKS_VERSION,
            user_data: std::ptr::null_mut(),
            paged_buft: buffer_type::buffer_type(),
            loader_file: Some(loader_file),
            is_paged: Some(is_paged),
            paged_weight: Some(paged_weight),
            resident_weight: Some(resident_weight),
            mapped_weight: Some(mapped_weight),
            model_loaded: Some(model_loaded),
            model_freed: Some(model_freed),
            take_load_error: Some(take_load_error),
            mul_mat_id: Some(mul_mat_id),
            moe_routing: Some(moe_routing),
            moe_experts: Some(moe_experts),
            abort_requested: Some(abort_requested),
            take_batch_error: Some(take_batch_error),
            compute_buffers: Some(compute_buffers),
            ubatch_begins: Some(ubatch_begins),
            group_size: Some(group_size),
            group_begins: Some(group_begins),
            group_room: Some(group_room),
            group_ends: Some(group_ends),
            expert_layer: Some(expert_layer),
            experts_ahead: Some(experts_ahead),
            group_layer: Some(group_layer),
            report: Some(report),
            shared_batch: Some(shared_batch),
            remote_paged: Some(rpc::remote_paged),
            rpc_claim: Some(rpc::rpc_claim),
            rpc_claimed: Some(rpc::rpc_claimed),
            rpc_encode_op: Some(rpc::rpc_encode_op),
            rpc_node_pages: Some(rpc::rpc_node_pages),
            rpc_node_failed: Some(rpc::rpc_node_failed),
            rpc_node_lost: Some(rpc::rpc_node_lost),
            rpc_losses: Some(rpc::rpc_losses),
            node_claim: Some(rpc::node_claim),
            node_weight_bytes: Some(rpc::node_weight_bytes),
            node_bind_op: Some(rpc::node_bind_op),
            node_buffers: Some(rpc::node_buffers),
        })
    });
    // SAFETY: the table is static, so it outlives every model.
    unsafe { sys::sdq_set_hooks(&table.0) };
    llama::remember_default_log();
}

extern "C" fn abort_requested(_: *mut c_void) -> bool {
    guard("abort_requested", failure::abort_requested)
}

extern "C" fn shared_batch(_: *mut c_void) -> i32 {
    guard("shared_batch", runtime::batching::shared_batch)
}

extern "C" fn compute_buffers(_: *mut c_void, ctx: *const c_void, bytes: usize, one_output: usize) {
    guard_load("compute_buffers", || {
        if let Some(rt) = runtime::get() {
            // SAFETY: the patched llama_context passes itself, its
            // parameters set before it reserves its buffers; llama_n_ctx
            // and llama_n_ubatch only read them.
            let (n_ctx, n_ubatch) = unsafe { (sys::llama_n_ctx(ctx.cast()), sys::llama_n_ubatch(ctx.cast())) };
            rt.on_compute_buffers(bytes as u64, one_output as u64, ContextSize { n_ctx: n_ctx as u64, n_ubatch: n_ubatch as u64 });
        }
    })
}

extern "C" fn ubatch_begins(_: *mut c_void, pos0: i32, _n_tokens: u32) {
    guard("ubatch_begins", || {
        moe::forget_left_calls();
        if let Some(rt) = runtime::get() {
            rt.on_ubatch(pos0);
        }
    })
}

extern "C" fn group_size(_: *mut c_void, n_ubatches: u32, _n_ubatch: u32) -> u32 {
    guard_or("group_size", During::Batch, 1, || runtime::get().map_or(1, |rt| rt.group_size(n_ubatches)))
}

extern "C" fn group_begins(_: *mut c_void, n_ubatches: u32, n_tokens: u32, bytes: usize, op_out: usize) {
    guard("group_begins", || {
        if let Some(rt) = runtime::get() {
            rt.on_group_begins(n_ubatches, u64::from(n_tokens), bytes as u64, op_out as u64);
        }
    })
}

extern "C" fn group_room(_: *mut c_void, n_staged: u32, bytes: usize, op_out: usize) -> bool {
    guard("group_room", || runtime::get().is_some_and(|rt| rt.group_room(n_staged, bytes as u64, op_out as u64)))
}

extern "C" fn group_ends(_: *mut c_void) {
    guard("group_ends", || {
        moe::group_ends();
        if let Some(rt) = runtime::get() {
            rt.on_group_ends();
        }
    })
}

extern "C" fn expert_layer(_: *mut c_void, node: *const sys::ggml_tensor) -> std::ffi::c_int {
    guard("expert_layer", || {
        // SAFETY: llama.cpp passes a node of a graph it built.
        unsafe { moe::expert_layer(&*node) }.map_or(-1, |l| l as std::ffi::c_int)
    })
}

extern "C" fn group_layer(_: *mut c_void, n: u32, nodes: *const *mut sys::ggml_tensor, kept: *const *const c_void) {
    guard("group_layer", || {
        // SAFETY: llama.cpp passes n op nodes of the group's graphs and
        // GGML_MAX_SRC kept pointers for each, valid while the layer's
        // ops run (sdq-hooks.h).
        unsafe {
            let nodes = std::slice::from_raw_parts(nodes, n as usize);
            let kept = std::slice::from_raw_parts(kept, n as usize * sys::GGML_MAX_SRC as usize);
            moe::group_layer(nodes, kept);
        }
    })
}

extern "C" fn experts_ahead(_: *mut c_void, node: *const sys::ggml_tensor) {
    // SAFETY: llama.cpp passes a node of a graph being computed, whose
    // routing (its sources) is computed.
    guard("experts_ahead", || unsafe { moe::read_ahead(&*node) })
}

extern "C" fn take_batch_error(_: *mut c_void, buf: *mut c_char, len: usize) -> bool {
    guard_or("take_batch_error", During::Query, Fallback::fallback(), || {
        let Some(msg) = failure::take_batch_error() else { return false };
        // SAFETY: the caller passes a buffer of len bytes.
        unsafe { write_c_string(&msg, buf, len) };
        true
    })
}

extern "C" fn take_load_error(_: *mut c_void, buf: *mut c_char, len: usize) -> bool {
    guard_or("take_load_error", During::Query, Fallback::fallback(), || {
        let Some(msg) = failure::take_load_error() else { return false };
        // SAFETY: the caller passes a buffer of len bytes.
        unsafe { write_c_string(&msg, buf, len) };
        true
    })
}

extern "C" fn report(_: *mut c_void, kind: i32, buf: *mut c_char, len: usize) -> usize {
    guard_or("report", During::Query, Fallback::fallback(), || {
        let Some(kind) = crate::engine::runtime::metrics::Report::from_c(kind) else { return 0 };
        let Some(text) = runtime::get().map(|rt| rt.report(kind)) else { return 0 };
        // SAFETY: the caller passes a buffer of len bytes (or len 0).
        unsafe { write_c_string(&text, buf, len) };
        text.len()
    })
}

/// Copies `text` into the C buffer `buf` of `len` bytes, cut to fit and
/// NUL-terminated; nothing with `len` 0.
///
/// # Safety
/// `buf` must be writable for `len` bytes (it may be null when `len` is 0).
unsafe fn write_c_string(text: &str, buf: *mut c_char, len: usize) {
    if len == 0 {
        return;
    }
    let n = text.len().min(len - 1);
    // SAFETY: n + 1 <= len bytes of buf, which the caller vouches for.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
}

/// # Safety
/// `t` must be a valid tensor.
unsafe fn tensor_name(t: *const sys::ggml_tensor) -> String {
    // SAFETY: ggml tensor names are NUL-terminated arrays.
    unsafe { CStr::from_ptr((*t).name.as_ptr()) }.to_string_lossy().into_owned()
}

extern "C" fn loader_file(_: *mut c_void, idx: u32, path: *const c_char) {
    guard_load("loader_file", || {
        // SAFETY: llama.cpp passes the path it opened, NUL-terminated.
        let path = unsafe { CStr::from_ptr(path) };
        let path = PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path.to_bytes()));
        if let Some(rt) = runtime::get() {
            rt.on_loader_file(idx, path);
        }
    })
}

extern "C" fn is_paged(_: *mut c_void, meta: *const sys::ggml_tensor, stock_buft: sys::ggml_backend_buffer_type_t) -> std::ffi::c_int {
    guard_load("is_paged", || {
        let Some(rt) = runtime::get() else { return sys::SDQ_STOCK as std::ffi::c_int };
        // SAFETY: llama.cpp passes a valid tensor descriptor.
        let (name, meta) = unsafe { (tensor_name(meta), &*meta) };
        if Part::from_tensor_name(&name).is_none() {
            return sys::SDQ_STOCK as std::ffi::c_int;
        }
        // A layer placed on an RPC node: that node pages its experts (the
        // host claims them for it once they exist; see crate::engine::rpc).
        // SAFETY: a pointer comparison and a read of ggml-rpc's own context.
        let endpoint = unsafe { sys::sdq_rpc_buft_endpoint(stock_buft) };
        if !endpoint.is_null() {
            // SAFETY: ggml-rpc's endpoint string, NUL-terminated.
            let endpoint = unsafe { CStr::from_ptr(endpoint) }.to_string_lossy();
            crate::engine::rpc::host::place(&name, &endpoint);
            return sys::SDQ_PAGED_ON_NODE as std::ffi::c_int;
        }
        // SAFETY: the loader passes the buffer type it chose, one of ggml's.
        let (layout, notice) = unsafe { WeightLayout::of(meta, stock_buft) };
        let paged = rt.is_paged(&name, GgmlType(meta.type_), layout, notice).unwrap_or_else(|e| {
            failure::fail_load(&e.to_string());
            false
        });
        (if paged { sys::SDQ_PAGED } else { sys::SDQ_STOCK }) as std::ffi::c_int
    })
}

extern "C" fn paged_weight(_: *mut c_void, t: *const sys::ggml_tensor, idx: u32, offs: u64) {
    guard_load("paged_weight", || {
        let Some(rt) = runtime::get() else { return };
        let address = t as usize;
        // SAFETY: llama.cpp passes the tensor it just created.
        let (name, t) = unsafe { (tensor_name(t), &*t) };
        let Some((layer, part)) = Part::from_tensor_name(&name) else { fatal(&format!("tensor {name} was paged but is not a routed expert")) };
        if let Some(endpoint) = crate::engine::rpc::host::placed_on(&name) {
            let path = rt.model_file(idx).unwrap_or_default();
            let tensor = PagedTensor { name, layer, part, ty: GgmlType(t.type_), ne: t.ne, nb: t.nb, file: idx, offset: offs, layout: WeightLayout::Plain };
            return crate::engine::rpc::host::on_weight(tensor, address, endpoint, path);
        }
        rt.on_paged_weight(
            PagedTensor {
                name,
                layer,
                part,
                ty: GgmlType(t.type_),
                ne: t.ne,
                nb: t.nb,
                file: idx,
                offset: offs,
                layout: WeightLayout::Plain, // the runtime fills in what is_paged decided
            },
            address,
        );
    })
}

extern "C" fn resident_weight(_: *mut c_void, t: *const sys::ggml_tensor) {
    guard_load("resident_weight", || {
        let Some(rt) = runtime::get() else { return };
        // SAFETY: llama.cpp passes the tensor it just created; it lives as
        // long as the model.
        let name = unsafe { tensor_name(t) };
        rt.on_resident_weight(&name, t as usize);
    })
}

extern "C" fn mapped_weight(_: *mut c_void, t: *const sys::ggml_tensor) {
    guard_load("mapped_weight", || {
        let Some(rt) = runtime::get() else { return };
        // SAFETY: llama.cpp passes the tensor it just placed in the mapping.
        let (name, bytes) = unsafe { (tensor_name(t), sys::ggml_nbytes(t) as u64) };
        rt.on_mapped_weight(name, bytes);
    })
}

extern "C" fn model_loaded(_: *mut c_void, model: *const sys::llama_model) {
    guard_load("model_loaded", || {
        if let Some(rt) = runtime::get() {
            rt.on_model_loaded(model as usize);
        }
    })
}

extern "C" fn model_freed(_: *mut c_void, model: *const sys::llama_model) {
    guard_or("model_freed", During::Query, (), || {
        if runtime::get().is_some_and(|rt| rt.on_model_freed(model as usize)) {
            moe::forget_left_calls();
            moe::forget_predictions();
        }
    })
}

/// The pager's name and layer of the paged weight `t` named `name` (the
/// loader's tensor): a model loaded after the first (a draft model) has its
/// layers numbered after the first's (see `runtime::LoadedModel`). None if
/// `name` is no routed expert's.
fn paged_name(t: *const sys::ggml_tensor, name: &str) -> Option<(String, u32, Part)> {
    let (layer, part) = Part::from_tensor_name(name)?;
    let paged = runtime::get().and_then(|rt| rt.paged_layer_of(t as usize)).unwrap_or(layer);
    Some((runtime::renumbered(name, paged - layer), paged, part))
}

/// The paged matmul ops made so far, by pager generation, tensor and layout.
type PagedMatmulOps = Mutex<HashMap<(u64, String, WeightLayout), &'static PagedMatmul>>;

/// One `PagedMatmul` per paged tensor name, kept for the process's lifetime
/// (graphs are rebuilt and reused; their userdata must stay valid).
fn paged_matmul(name: &str, layer: u32, part: Part, ty: GgmlType) -> &'static PagedMatmul {
    static OPS: OnceLock<PagedMatmulOps> = OnceLock::new();
    let layout = runtime::get().map_or(WeightLayout::Plain, |rt| rt.weight_layout(name));
    let mut ops = OPS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    ops.entry((generation(), name.to_string(), layout)).or_insert_with(|| {
        let kernels = DotKernels::for_type(ty).unwrap_or_else(|| fatal(&format!("{name}: no CPU dot product for {}", ty.name())));
        let (first_layer, last_layer) = runtime::get().map(|rt| rt.paged_layers()).unwrap_or((0, 0));
        Box::leak(Box::new(PagedMatmul {
            name: name.to_string(),
            layer,
            part,
            kernels,
            layout,
            // The step starts before its first lookups, which are the gate's.
            starts_step: matches!(part, Part::Gate | Part::GateUp) && layer == first_layer,
            ends_step: part == Part::Down && layer == last_layer,
        }))
    })
}

/// The paged layer ops made so far, by pager generation, layer and the
/// layouts of its parts.
type PagedExpertsOps = Mutex<HashMap<(u64, u32, [WeightLayout; 3]), &'static PagedExperts>>;

/// One `PagedExperts` per layer, kept for the process's lifetime.
fn paged_experts(names: &[String; 3], layer: u32, kernels: [DotKernels; 3]) -> &'static PagedExperts {
    static OPS: OnceLock<PagedExpertsOps> = OnceLock::new();
    let layouts = names.clone().map(|n| runtime::get().map_or(WeightLayout::Plain, |rt| rt.weight_layout(&n)));
    let mut ops = OPS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    ops.entry((generation(), layer, layouts)).or_insert_with(|| {
        let (first_layer, last_layer) = runtime::get().map(|rt| rt.paged_layers()).unwrap_or((0, 0));
        let [gate, up, down] = kernels;
        log::debug!("layer {layer}: gate, up, SwiGLU and down in one paged op ({}, {}, {})", layouts[0].name(), layouts[1].name(), layouts[2].name());
        let name = names[2].clone();
        moe::note_fused_layer();
        Box::leak(Box::new(PagedExperts { name, layer, gate, up, down, layouts, counts_tokens: layer == first_layer, ends_step: layer == last_layer }))
    })
}

/// The runtime's pager generation: an op made for a freed model's pager
/// (its layers' first and last, its top-k) is not reused for the next.
fn generation() -> u64 {
    runtime::get().map_or(0, |rt| rt.generation())
}

/// Every thread of the graph (GGML_N_TASKS_MAX) runs a paged op.
const ALL_THREADS: i32 = -1;

/// A custom op of type `ty` and shape `ne` over `args`, computed by `fun`
/// with `n_tasks` of ggml's threads and `userdata`.
///
/// # Safety
/// `ctx` must be the context of the graph being built and `args` valid
/// tensors of it; `fun` must accept `userdata`, which must live as long as
/// the graph may be computed (sdq's op descriptions are leaked).
unsafe fn custom_op(
    ctx: *mut sys::ggml_context,
    ty: sys::ggml_type,
    ne: [i64; 3],
    mut args: Vec<*mut sys::ggml_tensor>,
    fun: sys::ggml_custom_op_t,
    n_tasks: i32,
    userdata: *const c_void,
) -> *mut sys::ggml_tensor {
    // SAFETY: per this function's contract.
    unsafe { sys::ggml_custom_4d(ctx, ty, ne[0], ne[1], ne[2], 1, args.as_mut_ptr(), args.len() as i32, fun, n_tasks, userdata as *mut c_void) }
}

/// One `Predictor` per layer, kept for the process's lifetime.
fn predictor(layer: u32, next: u32, top_k: usize) -> &'static Predictor {
    static OPS: OnceLock<Mutex<HashMap<(u64, u32), &'static Predictor>>> = OnceLock::new();
    let mut ops = OPS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    ops.entry((generation(), layer)).or_insert_with(|| Box::leak(Box::new(Predictor { layer, next, top_k })))
}

/// The prediction of the next paged layer's experts from this layer's
/// expert input `b` ([n_embd, 1, n_tokens]): the next layer's router applied
/// to it, then `moe::predict_next`, which starts reading what it picks
/// (for a prompt batch, the union of its tokens' picks). None when there is
/// nothing to predict (the last layer, an arena of every expert, prefetch
/// off) or the tool reads the graph's matmuls (llama-imatrix).
///
/// # Safety
/// `ctx`, `b` and `ids` must be valid tensors of the graph being built.
unsafe fn build_prediction(ctx: *mut sys::ggml_context, layer: u32, b: *mut sys::ggml_tensor, ids: &sys::ggml_tensor) -> Option<*mut sys::ggml_tensor> {
    let rt = runtime::get()?;
    // A tool that reads the graph's matmuls (llama-imatrix) would count the
    // prediction's router matmul as the router's own.
    if PER_MATMUL_EXPERTS.load(Ordering::Relaxed) {
        return None;
    }
    // SAFETY: b is valid (contract).
    let bt = unsafe { &*b };
    // SAFETY: as above.
    if bt.ne[1] != 1 || !unsafe { sys::ggml_is_contiguous(b) } {
        return None;
    }
    let (next, router) = rt.next_router(layer)?;
    let router = router as *mut sys::ggml_tensor;
    // SAFETY: the router is a weight of the loaded model, alive as long as it.
    if unsafe { (*router).ne[0] } != bt.ne[0] {
        return None;
    }
    let op = predictor(layer, next, ids.ne[0] as usize);
    // SAFETY: ctx is the graph's context and every tensor is valid; the
    // callback and its leaked userdata live for the whole process.
    unsafe {
        let x = sys::ggml_reshape_2d(ctx, b, bt.ne[0], bt.ne[2]);
        let logits = sys::ggml_mul_mat(ctx, router, x);
        Some(custom_op(ctx, sys::GGML_TYPE_F32, [1, 1, 1], vec![logits], Some(moe::predict_next), 1, (op as *const Predictor).cast()))
    }
}

extern "C" fn mul_mat_id(
    _: *mut c_void,
    ctx: *mut sys::ggml_context,
    a: *mut sys::ggml_tensor,
    b: *mut sys::ggml_tensor,
    ids: *mut sys::ggml_tensor,
) -> *mut sys::ggml_tensor {
    guard("mul_mat_id", || {
        // SAFETY: llama.cpp passes valid tensors of the graph being built.
        let (name, at, bt, it) = unsafe { (tensor_name(a), &*a, &*b, &*ids) };
        let Some((name, layer, part)) = paged_name(a, &name) else { fatal(&format!("paged matmul for {name}, which is not a routed expert")) };
        let shape_ok = bt.type_ == sys::GGML_TYPE_F32
            && it.type_ == sys::GGML_TYPE_I32
            && bt.ne[0] == at.ne[0]
            && bt.ne[2] == it.ne[1]
            && (bt.ne[1] == 1 || bt.ne[1] == it.ne[0])
            && bt.nb[0] == 4
            && bt.ne[3] == 1;
        if !shape_ok {
            fatal(&format!("{name}: unsupported expert matmul shapes (b {:?} {}, ids {:?})", bt.ne, GgmlType(bt.type_).name(), it.ne));
        }
        let op = paged_matmul(&name, layer, part, GgmlType(at.type_));
        let mut args = vec![a, b, ids];
        // The prediction is the gate matmul's fourth source, which it does not
        // read: ggml computes it just before the layer's experts, once routing
        // is known, and the reads it starts queue behind the layer's own.
        // SAFETY: a is a valid tensor of the graph (above).
        if matches!(part, Part::Gate | Part::GateUp) && !crate::engine::rpc::host::is_on_node(a as usize, &unsafe { tensor_name(a) }) {
            // SAFETY: the tensors come from llama.cpp's graph (above).
            args.extend(unsafe { build_prediction(ctx, layer, b, it) });
        }
        // SAFETY: ctx is the graph's context; args are 3 or 4 valid tensors;
        // the callback and its leaked userdata live for the whole process.
        unsafe {
            custom_op(
                ctx,
                sys::GGML_TYPE_F32,
                [at.ne[1], it.ne[0], bt.ne[2]],
                args,
                Some(moe::paged_mul_mat_id),
                ALL_THREADS,
                (op as *const PagedMatmul).cast(),
            )
        }
    })
}

/// One `RoutingRecord` per layer, kept for the process's lifetime.
fn routing_record(layer: u32) -> &'static RoutingRecord {
    static OPS: OnceLock<Mutex<HashMap<(u64, u32), &'static RoutingRecord>>> = OnceLock::new();
    let mut ops = OPS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    ops.entry((generation(), layer)).or_insert_with(|| {
        let first_layer = runtime::get().map(|rt| rt.first_paged_layer()).unwrap_or(0);
        Box::leak(Box::new(RoutingRecord { layer, starts_step: layer == first_layer }))
    })
}

extern "C" fn moe_routing(
    _: *mut c_void,
    ctx: *mut sys::ggml_context,
    il: std::ffi::c_int,
    ids: *mut sys::ggml_tensor,
    weights: *mut sys::ggml_tensor,
) -> *mut sys::ggml_tensor {
    guard("moe_routing", || {
        if !runtime::get().is_some_and(|rt| rt.tracing()) {
            return std::ptr::null_mut();
        }
        // SAFETY: llama.cpp passes valid tensors of the graph being built.
        let (it, wt) = unsafe { (&*ids, &*weights) };
        let fits = it.type_ == sys::GGML_TYPE_I32
            && wt.type_ == sys::GGML_TYPE_F32
            && il >= 0
            && it.ne[2] == 1
            && it.ne[3] == 1
            && wt.ne[0] == 1
            && wt.ne[1] == it.ne[0]
            && wt.ne[2] == it.ne[1];
        if !fits {
            fatal(&format!("layer {il}: unsupported routing shapes for --sdq-trace (ids {:?}, weights {:?})", it.ne, wt.ne));
        }
        let op = routing_record(il as u32);
        // SAFETY: ctx is the graph's context; ids and weights are valid
        // tensors of it; the callback and its leaked userdata live for the
        // whole process.
        unsafe {
            custom_op(ctx, sys::GGML_TYPE_I32, [it.ne[0], it.ne[1], 1], vec![ids, weights], Some(moe::record_routing), 1, (op as *const RoutingRecord).cast())
        }
    })
}

/// Set for tools that read each expert matmul's input from the graph
/// (llama-imatrix): every paged layer then takes the three per-matmul ops,
/// whose sources are ggml_mul_mat_id's, instead of the fused one.
static PER_MATMUL_EXPERTS: AtomicBool = AtomicBool::new(false);

/// Builds paged layers as three expert matmuls (gate, up, down) with
/// ggml_mul_mat_id's sources, never the fused op.
pub fn use_per_matmul_experts() {
    PER_MATMUL_EXPERTS.store(true, Ordering::Relaxed);
}

extern "C" fn moe_experts(
    _: *mut c_void,
    ctx: *mut sys::ggml_context,
    gate: *mut sys::ggml_tensor,
    up: *mut sys::ggml_tensor,
    down: *mut sys::ggml_tensor,
    b: *mut sys::ggml_tensor,
    ids: *mut sys::ggml_tensor,
) -> *mut sys::ggml_tensor {
    guard("moe_experts", || {
        if PER_MATMUL_EXPERTS.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        // SAFETY: llama.cpp passes valid tensors of the graph being built.
        let (gt, ut, dt, bt, it) = unsafe { (&*gate, &*up, &*down, &*b, &*ids) };
        // SAFETY: as above.
        let (names, paged) = unsafe { ([tensor_name(gate), tensor_name(up), tensor_name(down)], [gate, up].iter().all(|&t| sys::sdq_is_paged_tensor(t))) };
        let parts: Vec<_> = names.iter().zip([gate, up, down]).map(|(n, t)| paged_name(t, n)).collect();
        let (names, layer) = match &parts[..] {
            [Some((g, l, Part::Gate)), Some((u, lu, Part::Up)), Some((d, ld, Part::Down))] if l == lu && l == ld => ([g.clone(), u.clone(), d.clone()], *l),
            _ => return std::ptr::null_mut(),
        };
        let kernels = [gt, ut, dt].map(|t| DotKernels::for_type(GgmlType(t.type_)));
        let [Some(kg), Some(ku), Some(kd)] = kernels else { return std::ptr::null_mut() };
        // Anything else is left to the three matmuls, which check (and
        // report) their own shapes.
        // SAFETY: b is valid (above).
        let fits = paged
            && bt.type_ == sys::GGML_TYPE_F32
            && unsafe { sys::ggml_is_contiguous(b) }
            && bt.ne[1] == 1
            && bt.ne[3] == 1
            && it.type_ == sys::GGML_TYPE_I32
            && it.ne[1] == bt.ne[2]
            && gt.ne[0] == bt.ne[0]
            && ut.ne[0] == bt.ne[0]
            && gt.ne[1] == ut.ne[1]
            && dt.ne[0] == gt.ne[1]
            && kg.activation == ku.activation;
        if !fits {
            return std::ptr::null_mut();
        }
        let op = paged_experts(&names, layer, [kg, ku, kd]);
        let mut args = vec![gate, up, down, b, ids];
        // The prediction is a source the op does not read: ggml computes it
        // just before the layer's experts, once routing is known (see
        // mul_mat_id).
        // (None for a layer paged on an RPC node: its pager is the node's.)
        if !crate::engine::rpc::host::is_on_node(gate as usize, &names[0]) {
            // SAFETY: the tensors come from llama.cpp's graph (above).
            args.extend(unsafe { build_prediction(ctx, layer, b, it) });
        }
        // SAFETY: ctx is the graph's context; args are 5 or 6 valid tensors;
        // the callback and its leaked userdata live for the whole process.
        unsafe {
            custom_op(
                ctx,
                sys::GGML_TYPE_F32,
                [dt.ne[1], it.ne[0], bt.ne[2]],
                args,
                Some(moe::paged_moe_experts),
                ALL_THREADS,
                (op as *const PagedExperts).cast(),
            )
        }
    })
}
