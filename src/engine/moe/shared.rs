//! A prompt group's expert ops shared: at each paged layer, the group's
//! first ubatch's op computes the experts of every ubatch of the group, so
//! each expert is pinned (and read) once per group however small the arena,
//! and each later ubatch's op copies what was computed for it.
//!
//! The ubatches take turns in one compute buffer, so a later ubatch's input
//! and routing are where it keeps them aside between pieces
//! (`shim/sdq-pieces.h`, told by `group_layer`), and its output is kept
//! here until its own op runs. Each ubatch's values are computed by the
//! same kernels on the same rows as in its own op, so they are the same to
//! the bit; only when (and in which op) they are computed changes.

use crate::engine::ffi::sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// Set once a paged layer is built as one op (`paged_moe_experts`): only
/// such an op computes a whole layer from its input, which a later
/// ubatch keeps aside (a layer of three matmuls computes its down's input
/// inside the piece).
static FUSED_LAYERS: AtomicBool = AtomicBool::new(false);

/// A paged layer was built as one op.
pub fn note_fused_layer() {
    FUSED_LAYERS.store(true, Ordering::Relaxed);
}

/// Whether any paged layer was built as one op.
pub fn fused_layers_built() -> bool {
    FUSED_LAYERS.load(Ordering::Relaxed)
}

/// One ubatch of the group at the layer.
struct Member {
    /// Its op (the graph node's address, the op's key).
    node: usize,
    /// Where its input and routing are kept aside (0 for the first ubatch,
    /// whose own are in the compute buffer when its op runs).
    input: usize,
    routing: usize,
    /// Its op's output as the first's op computes it (empty for the first,
    /// which writes its own).
    out: Vec<u8>,
}

#[derive(Default)]
struct State {
    /// The thread computing the group whose layer is shared (the one that
    /// called `llama_decode`): a host program's other context, decoding
    /// on another thread at the same time, computes its own experts
    /// rather than take this group's buffers.
    owner: Option<std::thread::ThreadId>,
    /// The layer being computed, while its experts are shared.
    members: Vec<Member>,
    /// Whether the first ubatch's op took the layer: until it has, a later
    /// ubatch's op computes its own experts.
    taken: bool,
    /// Output buffers of the layer before, reused (their size is the same
    /// at every layer).
    spare: Vec<Vec<u8>>,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, State> {
    state().lock().unwrap_or_else(|p| p.into_inner())
}

/// A later ubatch's input and routing, as its op's sources with their data
/// where the ubatch keeps them aside, and where its output goes.
pub(super) struct Kept {
    pub(super) input: sys::ggml_tensor,
    pub(super) routing: sys::ggml_tensor,
    pub(super) out: *mut u8,
    pub(super) nb1: usize,
    pub(super) nb2: usize,
}

/// What op `node` is in the layer being shared.
pub(super) enum Role {
    /// Not shared: it computes its own experts.
    Alone,
    /// The first ubatch's: it computes the experts of these later ubatches too.
    First(Vec<Kept>),
    /// A later ubatch's, already computed: its output is these bytes.
    Copy(*const u8, usize),
}

/// The group's ubatches reach a layer at ops `nodes`, the first ubatch's
/// first; `kept` holds GGML_MAX_SRC pointers per op, where each source is
/// kept aside. The layer is shared where the group shares its expert ops
/// and every op is a whole layer's, with its input and routing kept aside.
///
/// # Safety
/// `nodes` must be valid op nodes of the group's graphs, which outlive the
/// layer's ops, and each `kept` pointer (or null) valid until its ubatch's
/// op has run.
pub unsafe fn group_layer(nodes: &[*mut sys::ggml_tensor], kept: &[*const c_void]) {
    let mut st = lock();
    let me = std::thread::current().id();
    if st.owner.is_some_and(|o| o != me) {
        log::debug!("a prompt group on another thread shares its expert ops: this group's {} ubatches compute their own", nodes.len());
        return;
    }
    st.owner = None;
    let old = std::mem::take(&mut st.members);
    st.spare.extend(old.into_iter().map(|m| m.out).filter(|b| !b.is_empty()));
    st.taken = false;
    let shares = crate::engine::runtime::get().is_some_and(|rt| rt.group_shares());
    if !shares || nodes.len() < 2 {
        log::debug!("a prompt group's {} ubatches reach a layer, not shared (shares: {shares})", nodes.len());
        return;
    }
    // Every op must be a whole layer's, each later one with its input
    // and routing kept aside.
    let srcs = sys::GGML_MAX_SRC as usize;
    let kept_at = |i: usize| (kept[i * srcs + 3] as usize, kept[i * srcs + 4] as usize);
    // SAFETY: per this function's contract, each node is a valid graph node.
    if let Some(i) = nodes.iter().position(|&n| !unsafe { super::is_fused(&*n) }) {
        log::debug!("a prompt group's ubatch {i} has no whole-layer expert op: the layer is not shared");
        return;
    }
    if let Some(i) = (1..nodes.len()).find(|&i| kept_at(i).0 == 0 || kept_at(i).1 == 0) {
        log::debug!("a prompt group's ubatch {i} does not keep its expert input aside: the layer is not shared");
        return;
    }
    let mut members = Vec::with_capacity(nodes.len());
    members.push(Member { node: nodes[0] as usize, input: 0, routing: 0, out: Vec::new() });
    for (i, &node) in nodes.iter().enumerate().skip(1) {
        // SAFETY: node is a valid tensor (this function's contract).
        let bytes = unsafe { sys::ggml_nbytes(node) };
        let mut out = st.spare.pop().unwrap_or_default();
        out.resize(bytes, 0);
        let (input, routing) = kept_at(i);
        members.push(Member { node: node as usize, input, routing, out });
    }
    log::debug!("a prompt group's {} ubatches share their expert op at layer {}", members.len(), {
        // SAFETY: nodes[0] is a valid fused op (checked above).
        unsafe { super::expert_op(&*nodes[0]) }.map_or(u32::MAX, |(l, _)| l)
    });
    st.members = members;
    st.owner = Some(me);
}

/// What op `dst` is in the layer being shared (see `Role`). The first
/// ubatch's op takes the layer when it asks.
///
/// # Safety
/// `dst` must be a fused expert op being computed.
pub(super) unsafe fn role(dst: &sys::ggml_tensor) -> Role {
    let key = dst as *const sys::ggml_tensor as usize;
    let mut st = lock();
    let Some(i) = st.members.iter().position(|m| m.node == key) else { return Role::Alone };
    if i > 0 {
        return if st.taken { Role::Copy(st.members[i].out.as_ptr(), st.members[i].out.len()) } else { Role::Alone };
    }
    st.taken = true;
    let kept = st.members[1..]
        .iter_mut()
        .map(|m| {
            // SAFETY: m.node is a later ubatch's op of this layer, alive for
            // the group (group_layer's contract), a fused op whose sources 3
            // and 4 are its input and routing; their kept copies have the
            // same shape and strides.
            unsafe {
                let node = &*(m.node as *const sys::ggml_tensor);
                let (mut input, mut routing) = (*node.src[3], *node.src[4]);
                input.data = m.input as *mut c_void;
                routing.data = m.routing as *mut c_void;
                Kept { input, routing, out: m.out.as_mut_ptr(), nb1: node.nb[1], nb2: node.nb[2] }
            }
        })
        .collect();
    Role::First(kept)
}

/// The group is computed (or failed): its outputs are freed. Not another
/// thread's group's, which may still be computing into them.
pub fn group_ends() {
    let mut st = lock();
    if st.owner.is_some_and(|o| o != std::thread::current().id()) {
        return;
    }
    *st = State::default();
}
