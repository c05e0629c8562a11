//! The RPC hooks (patch 0015): on the host, the claims on weights its RPC
//! nodes page and sdq's op named for the wire; on a node, the claims it
//! answers and the ops it binds to its own functions and pager.

use super::{paged_experts, paged_matmul, predictor, tensor_name};
use crate::engine::ffi::ggml::{DotKernels, GgmlType};
use crate::engine::ffi::sys;
use crate::engine::moe::{self, PagedExperts, PagedMatmul, Predictor};
use crate::engine::pager::layout::Part;
use crate::engine::rpc::{self, host, node};
use crate::engine::runtime::failure::{self, fatal, guard, guard_load, guard_or, During};
use crate::engine::runtime::{self, phases::ContextSize};
use std::ffi::{c_char, c_int, c_void, CStr};

/// ggml's `struct ggml_custom_op_params` (ggml-impl.h, not a public header):
/// what `ggml_custom_4d` writes at the start of a custom op's op_params.
#[repr(C)]
struct CustomOpParams {
    fun: sys::ggml_custom_op_t,
    n_tasks: c_int,
    userdata: *mut c_void,
}

const _: () = assert!(std::mem::size_of::<CustomOpParams>() <= 64 && std::mem::size_of::<sys::sdq_rpc_op>() <= 64);

/// # Safety
/// `s` must be NULL or a NUL-terminated string.
unsafe fn endpoint(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

pub(super) extern "C" fn remote_paged(_: *mut c_void, t: *const sys::ggml_tensor) -> bool {
    // SAFETY: llama.cpp passes a tensor with a buffer (a valid tensor).
    guard("remote_paged", || host::is_on_node(t as usize, &unsafe { tensor_name(t) }))
}

pub(super) extern "C" fn rpc_claim(_: *mut c_void, t: *const sys::ggml_tensor, ep: *const c_char, claim: *mut sys::sdq_rpc_claim) -> bool {
    guard_load("rpc_claim", || {
        // SAFETY: ggml-rpc passes its buffer type's endpoint and a valid tensor.
        let (ep, name) = unsafe { (endpoint(ep), tensor_name(t)) };
        match host::claim(t as usize, &name, &ep) {
            None => false,
            Some(Ok(c)) => {
                // SAFETY: ggml-rpc passes a claim to fill.
                unsafe {
                    *claim = sys::sdq_rpc_claim {
                        magic: sys::SDQ_RPC_MAGIC,
                        file: c.file,
                        file_size: c.file_id.size,
                        offset: c.offset,
                        header_hash: c.file_id.header_hash,
                        sample_hash: c.sample_hash,
                    };
                }
                true
            }
            Some(Err(e)) => {
                failure::fail_load(&e);
                false
            }
        }
    })
}

pub(super) extern "C" fn rpc_claimed(_: *mut c_void, t: *const sys::ggml_tensor, ep: *const c_char, answer: u64) -> usize {
    guard_load("rpc_claimed", || {
        // SAFETY: ggml-rpc passes its buffer type's endpoint and a valid tensor.
        let (ep, name) = unsafe { (endpoint(ep), tensor_name(t)) };
        if let Err(e) = host::claimed(t as usize, &name, &ep, answer) {
            // The loader throws it before reading any weight (a tool ends with it).
            failure::fail_load(&e);
        }
        rpc::CLAIMED_BYTES as usize
    })
}

pub(super) extern "C" fn rpc_encode_op(_: *mut c_void, node: *const sys::ggml_tensor, op_params: *mut i32) -> bool {
    guard("rpc_encode_op", || {
        // SAFETY: ggml-rpc passes a custom op of the graph it serializes;
        // its op_params start with ggml's custom op parameters.
        let p = unsafe { std::ptr::read_unaligned((*node).op_params.as_ptr().cast::<CustomOpParams>()) };
        let Some(fun) = p.fun else { return false };
        let f = fun as *const ();
        let (kind, layer, next, top_k) = if f == moe::paged_moe_experts as *const () {
            // SAFETY: sdq's ops carry their leaked descriptions as userdata.
            let op = unsafe { &*p.userdata.cast::<PagedExperts>() };
            (sys::SDQ_RPC_OP_EXPERTS, op.layer, 0, 0)
        } else if f == moe::paged_mul_mat_id as *const () {
            // SAFETY: as above.
            let op = unsafe { &*p.userdata.cast::<PagedMatmul>() };
            (sys::SDQ_RPC_OP_MUL_MAT_ID, op.layer, 0, 0)
        } else if f == moe::predict_next as *const () {
            // SAFETY: as above.
            let op = unsafe { &*p.userdata.cast::<Predictor>() };
            (sys::SDQ_RPC_OP_PREDICT, op.layer, op.next, op.top_k as u32)
        } else {
            return false;
        };
        let named = sys::sdq_rpc_op { magic: sys::SDQ_RPC_MAGIC, kind, n_tasks: p.n_tasks, layer: layer as i32, next: next as i32, top_k: top_k as i32 };
        // SAFETY: op_params holds GGML_MAX_OP_PARAMS (64) bytes; the name fits (asserted above).
        unsafe {
            std::ptr::write_bytes(op_params.cast::<u8>(), 0, 64);
            std::ptr::write_unaligned(op_params.cast::<sys::sdq_rpc_op>(), named);
        }
        true
    })
}

pub(super) extern "C" fn rpc_node_pages(_: *mut c_void, ep: *const c_char) -> bool {
    // SAFETY: ggml-rpc passes its device's endpoint.
    guard("rpc_node_pages", || host::node_pages(&unsafe { endpoint(ep) }))
}

pub(super) extern "C" fn rpc_node_failed(_: *mut c_void, ep: *const c_char, message: *const c_char) {
    guard("rpc_node_failed", || {
        // SAFETY: ggml-rpc passes its endpoint and the node's NUL-terminated message.
        let (ep, message) = unsafe { (endpoint(ep), endpoint(message)) };
        failure::fail_batch_elsewhere(&format!("rpc node {ep}: {message}"));
    })
}

pub(super) extern "C" fn rpc_node_lost(_: *mut c_void, ep: *const c_char, what: *const c_char, can_go_on: bool) -> bool {
    // SAFETY: ggml-rpc passes its endpoint and a static string.
    let (ep, what) = unsafe { (endpoint(ep), endpoint(what)) };
    let msg = format!(
        "rpc node {ep} is gone: its connection closed or stopped answering ({what}); the layers placed on it cannot be computed (a node that stops answering is given up after about 25 s)"
    );
    // llama-server and a host program go on: this batch fails, and so does
    // every later one that needs the node. A tool ends here. This runs on
    // ggml-rpc's dispatcher thread, outside any guard: nothing may unwind.
    if !can_go_on || !failure::batches_fail_alone() {
        fatal(&msg)
    }
    guard("rpc_node_lost", || {
        host::lose(&ep);
        failure::fail_batch_elsewhere(&msg);
        true
    })
}

pub(super) extern "C" fn rpc_losses(_: *mut c_void) -> i64 {
    guard_or("rpc_losses", During::Query, -1, || host::losses().map_or(-1, |n| n as i64))
}

pub(super) extern "C" fn node_claim(_: *mut c_void, t: *const sys::ggml_tensor, claim: *const sys::sdq_rpc_claim) -> u64 {
    guard("node_claim", || {
        // SAFETY: ggml-rpc passes the deserialized tensor and the claim it carried.
        let (name, tt, c) = unsafe { (tensor_name(t), &*t, &*claim) };
        node::claim(&node::Claim {
            name: &name,
            ty: GgmlType(tt.type_),
            ne: tt.ne,
            file: c.file,
            file_id: rpc::FileId { size: c.file_size, header_hash: c.header_hash },
            offset: c.offset,
            sample_hash: c.sample_hash,
        })
    })
}

pub(super) extern "C" fn node_weight_bytes(_: *mut c_void, t: *const sys::ggml_tensor) -> usize {
    // SAFETY: ggml-rpc passes a deserialized tensor with its name set.
    guard("node_weight_bytes", || node::weight_bytes(&unsafe { tensor_name(t) }).unwrap_or(0) as usize)
}

pub(super) extern "C" fn node_buffers(_: *mut c_void, bytes: u64) {
    guard("node_buffers", || {
        if let Some(rt) = runtime::get() {
            // The host's weights, caches and compute buffers here, counted
            // as held once touched (as a context's compute buffers are).
            rt.on_compute_buffers(bytes, bytes, ContextSize::default());
        }
    })
}

/// A predicted layer this node does not page: nothing to read ahead here.
extern "C" fn predict_elsewhere(_: *mut sys::ggml_tensor, _: c_int, _: c_int, _: *mut c_void) {}

pub(super) extern "C" fn node_bind_op(_: *mut c_void, node: *mut sys::ggml_tensor) -> bool {
    guard("node_bind_op", || {
        // SAFETY: ggml-rpc passes a deserialized node whose op_params carry
        // sdq's name for the op and whose sources are linked.
        let (named, t) = unsafe { (std::ptr::read_unaligned((*node).op_params.as_ptr().cast::<sys::sdq_rpc_op>()), &*node) };
        let src = |i: usize| t.src[i];
        // SAFETY: sources are NULL or deserialized tensors with their names.
        let name = |i: usize| (!src(i).is_null()).then(|| unsafe { tensor_name(src(i)) });
        let weight = |i: usize| -> Option<(String, u32, Part, GgmlType)> {
            let n = name(i)?;
            let (layer, part) = Part::from_tensor_name(&n)?;
            node::weight_bytes(&n)?;
            // SAFETY: src(i) is non-NULL (name above).
            Some((n, layer, part, GgmlType(unsafe { (*src(i)).type_ })))
        };
        let bound: Option<(sys::ggml_custom_op_t, *const c_void)> = match named.kind {
            sys::SDQ_RPC_OP_EXPERTS => (|| {
                let [g, u, d] = [weight(0)?, weight(1)?, weight(2)?];
                let kernels = [DotKernels::for_type(g.3)?, DotKernels::for_type(u.3)?, DotKernels::for_type(d.3)?];
                let op = paged_experts(&[g.0, u.0, d.0], d.1, kernels);
                Some((Some(moe::paged_moe_experts as _), (op as *const PagedExperts).cast()))
            })(),
            sys::SDQ_RPC_OP_MUL_MAT_ID => (|| {
                let (n, layer, part, ty) = weight(0)?;
                let op = paged_matmul(&n, layer, part, ty);
                Some((Some(moe::paged_mul_mat_id as _), (op as *const PagedMatmul).cast()))
            })(),
            sys::SDQ_RPC_OP_PREDICT => {
                let pages_next = runtime::get().is_some_and(|rt| rt.pages_layer(named.next as u32));
                if pages_next {
                    let op = predictor(named.layer as u32, named.next as u32, named.top_k as usize);
                    Some((Some(moe::predict_next as _), (op as *const Predictor).cast()))
                } else {
                    Some((Some(predict_elsewhere as _), std::ptr::null()))
                }
            }
            _ => None,
        };
        let Some((fun, userdata)) = bound else {
            log::error!("an op of sdq (kind {}, layer {}) over weights this node does not page", named.kind, named.layer);
            return false;
        };
        let p = CustomOpParams { fun, n_tasks: named.n_tasks, userdata: userdata as *mut c_void };
        // SAFETY: op_params holds 64 bytes, more than CustomOpParams (asserted above).
        unsafe {
            std::ptr::write_bytes((*node).op_params.as_mut_ptr().cast::<u8>(), 0, 64);
            std::ptr::write_unaligned((*node).op_params.as_mut_ptr().cast::<CustomOpParams>(), p);
        }
        true
    })
}
