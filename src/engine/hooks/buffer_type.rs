//! The paged buffer type: where llama.cpp places routed-expert weights that
//! stay in the file. Each such tensor gets a 4 KiB placeholder (its shape and
//! strides are unchanged); loading writes nothing into it, and the expert
//! matmul reads the real bytes from the pager instead.

use crate::engine::ffi::sys;
use crate::engine::runtime::failure::{fatal, guard, guard_load};
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

/// Bytes reserved per paged tensor. ggml checks alloc_size >= nbytes only
/// with a plain assert, compiled out in the Release build (see build/cmake.rs).
pub const PLACEHOLDER_BYTES: usize = 4096;

struct BufferType(Box<sys::ggml_backend_buffer_type>);

// SAFETY: the struct is written once at creation and only read afterwards,
// by ggml, through the pointer handed out below.
unsafe impl Send for BufferType {}
// SAFETY: as above.
unsafe impl Sync for BufferType {}

static BUFFER_TYPE: OnceLock<BufferType> = OnceLock::new();

/// The paged buffer type (one per process; its address identifies it).
pub fn buffer_type() -> sys::ggml_backend_buffer_type_t {
    let bt = BUFFER_TYPE.get_or_init(|| {
        BufferType(Box::new(sys::ggml_backend_buffer_type {
            iface: sys::ggml_backend_buffer_type_i {
                get_name: Some(buft_get_name),
                alloc_buffer: Some(buft_alloc_buffer),
                get_alignment: Some(buft_get_alignment),
                get_max_size: None,
                get_alloc_size: Some(buft_get_alloc_size),
                is_host: Some(buft_is_host),
            },
            // NULL: llama.cpp attaches the CPU device.
            device: std::ptr::null_mut(),
            context: std::ptr::null_mut(),
        }))
    });
    &*bt.0 as *const sys::ggml_backend_buffer_type as sys::ggml_backend_buffer_type_t
}

const BUFFER_IFACE: sys::ggml_backend_buffer_i = sys::ggml_backend_buffer_i {
    free_buffer: Some(buf_free),
    get_base: Some(buf_get_base),
    init_tensor: None,
    memset_tensor: Some(buf_memset_tensor),
    set_tensor: Some(buf_set_tensor),
    get_tensor: Some(buf_get_tensor),
    set_tensor_2d: None,
    get_tensor_2d: None,
    cpy_tensor: None,
    clear: Some(buf_clear),
    reset: None,
};

extern "C" fn buft_get_name(_: sys::ggml_backend_buffer_type_t) -> *const c_char {
    // A constant: nothing that could panic (no guard needed).
    c"SDQ_Paged".as_ptr()
}

extern "C" fn buft_alloc_buffer(buft: sys::ggml_backend_buffer_type_t, size: usize) -> sys::ggml_backend_buffer_t {
    guard_load("the paged buffer's allocation", || {
        // The placeholders are real host memory, so any code that trusts is_host
        // touches valid (zeroed) bytes rather than wild pointers. The base must be
        // aligned: ggml's allocator aligns the first offset up, and the buffer
        // holds no slack for that.
        let mut mem: *mut c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign writes one pointer to a block of at least one
        // byte (freed in buf_free), which is then zeroed.
        unsafe {
            if libc::posix_memalign(&mut mem, PLACEHOLDER_BYTES, size.max(1)) != 0 {
                return std::ptr::null_mut();
            }
            libc::memset(mem, 0, size.max(1));
        }
        // SAFETY: buft is our buffer type, the interface is static and `mem` is
        // owned by the buffer from here on.
        unsafe { sys::ggml_backend_buffer_init(buft, BUFFER_IFACE, mem, size) }
    })
}

extern "C" fn buft_get_alignment(_: sys::ggml_backend_buffer_type_t) -> usize {
    // A constant: nothing that could panic (no guard needed).
    32
}

extern "C" fn buft_get_alloc_size(_: sys::ggml_backend_buffer_type_t, _: *const sys::ggml_tensor) -> usize {
    // A constant: nothing that could panic (no guard needed).
    PLACEHOLDER_BYTES
}

extern "C" fn buft_is_host(_: sys::ggml_backend_buffer_type_t) -> bool {
    // Required for the CPU backend to accept the tensors as op sources.
    true
}

extern "C" fn buf_free(buf: sys::ggml_backend_buffer_t) {
    guard("freeing a paged buffer", || {
        // SAFETY: ggml passes a buffer created by buft_alloc_buffer, whose context is the posix_memalign'd block.
        unsafe { libc::free((*buf).context) }
    })
}

extern "C" fn buf_get_base(buf: sys::ggml_backend_buffer_t) -> *mut c_void {
    guard("a paged buffer's base", || {
        // SAFETY: as in buf_free.
        unsafe { (*buf).context }
    })
}

extern "C" fn buf_memset_tensor(_: sys::ggml_backend_buffer_t, _: *mut sys::ggml_tensor, _: u8, _: usize, _: usize) {
    // Nothing to do, and nothing that could panic (no guard needed).
}

extern "C" fn buf_set_tensor(_: sys::ggml_backend_buffer_t, _: *mut sys::ggml_tensor, _: *const c_void, _: usize, _: usize) {
    // The bytes stay in the model file; the pager reads them on demand.
}

extern "C" fn buf_get_tensor(_: sys::ggml_backend_buffer_t, t: *const sys::ggml_tensor, _: *mut c_void, _: usize, _: usize) {
    guard("reading a paged tensor back", || {
        // SAFETY: ggml passes a valid tensor; its name is a NUL-terminated array.
        let name = unsafe { std::ffi::CStr::from_ptr((*t).name.as_ptr()) }.to_string_lossy().into_owned();
        fatal(&format!("tensor {name} is paged from the model file; its data cannot be read back (run without --ram-budget)"));
    })
}

extern "C" fn buf_clear(buf: sys::ggml_backend_buffer_t, value: u8) {
    guard("clearing a paged buffer", || {
        // SAFETY: the context block holds (*buf).size bytes.
        unsafe { libc::memset((*buf).context, value as i32, (*buf).size) };
    })
}
