//! A batch's activations, converted once per call into the weights'
//! `vec_dot_type` by all of ggml's threads together.

use crate::engine::ffi::ggml::DotKernels;
use crate::engine::ffi::sys;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A batch's activations, converted once to the weights' `vec_dot_type` by
/// all of the call's threads together, one row per (b row, token) in the
/// layout stock's mul_mat_id uses (row t·ne11 + i11), which is what its
/// tiled kernel reads.
pub(super) struct Activations {
    /// Written through `base` while converting, read-only after.
    pub(super) buf: Vec<u8>,
    base: *mut u8,
    row_bytes: usize,
    rows: usize,
    /// The next row nobody has claimed to convert.
    next: AtomicUsize,
    /// Rows converted.
    done: AtomicUsize,
}

// SAFETY: rows are written only by the thread that claimed them (through
// `next`) and read only after `done` says every row is written.
unsafe impl Sync for Activations {}
// SAFETY: as above; the buffer is owned.
unsafe impl Send for Activations {}

/// Rows converted per claim.
const CONVERT_CHUNK: usize = 8;

/// Conversion buffers of finished calls, reused so a batch does not fault in
/// fresh memory for every matmul.
fn spare_buffers() -> &'static Mutex<Vec<Vec<u8>>> {
    static B: OnceLock<Mutex<Vec<Vec<u8>>>> = OnceLock::new();
    B.get_or_init(Default::default)
}

impl Activations {
    pub(super) fn new(row_bytes: usize, rows: usize) -> Activations {
        let len = row_bytes * rows;
        let mut buf = {
            let mut spare = spare_buffers().lock().unwrap_or_else(|p| p.into_inner());
            let best = spare.iter().position(|b| b.capacity() >= len);
            best.map(|i| spare.swap_remove(i)).or_else(|| spare.pop()).unwrap_or_default()
        };
        buf.resize(len, 0);
        let base = buf.as_mut_ptr();
        Activations { buf, base, row_bytes, rows, next: AtomicUsize::new(0), done: AtomicUsize::new(0) }
    }

    /// Converts rows until none is left to claim, then waits for the rows
    /// other threads claimed.
    ///
    /// # Safety
    /// `b` must be the batch's F32 tensor [cols, ne11, n_tokens] with
    /// contiguous rows, ne11 · n_tokens = `self.rows`, and `kernels`' rows
    /// of `cols` values `row_bytes` long.
    pub(super) unsafe fn convert(&self, b: &sys::ggml_tensor, kernels: &DotKernels) {
        let (cols, ne11) = (b.ne[0] as usize, b.ne[1] as usize);
        loop {
            let first = self.next.fetch_add(CONVERT_CHUNK, Ordering::Relaxed);
            if first >= self.rows {
                break;
            }
            let end = (first + CONVERT_CHUNK).min(self.rows);
            for row in first..end {
                // SAFETY: row < rows = ne11 · n_tokens, so (t, i11) is a row
                // of b; this thread alone claimed `row` of the buffer, which
                // holds rows · row_bytes bytes.
                let (src, dst) = unsafe {
                    let p = (b.data as *const u8).add((row / ne11) * b.nb[2] + (row % ne11) * b.nb[1]);
                    (std::slice::from_raw_parts(p as *const f32, cols), std::slice::from_raw_parts_mut(self.base.add(row * self.row_bytes), self.row_bytes))
                };
                kernels.convert_activation(src, dst);
            }
            self.done.fetch_add(end - first, Ordering::Release);
        }
        let mut spins = 0u32;
        while self.done.load(Ordering::Acquire) < self.rows {
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Activations {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut spare = spare_buffers().lock().unwrap_or_else(|p| p.into_inner());
        // One buffer per concurrent call is plenty (a server runs one graph at a time).
        if spare.len() < 4 {
            spare.push(buf);
        }
    }
}
