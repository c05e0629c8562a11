//! Safe access to the parts of ggml this crate uses directly: tensor types and
//! their sizes, and ggml's own quantizers.

use crate::sys;
use std::ffi::CStr;

/// A ggml tensor type (`GGML_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub sys::ggml_type);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(sys::GGML_TYPE_F32);
    pub const F16: GgmlType = GgmlType(sys::GGML_TYPE_F16);
    pub const Q4_0: GgmlType = GgmlType(sys::GGML_TYPE_Q4_0);
    pub const Q8_0: GgmlType = GgmlType(sys::GGML_TYPE_Q8_0);
    pub const Q4_K: GgmlType = GgmlType(sys::GGML_TYPE_Q4_K);
    pub const Q5_K: GgmlType = GgmlType(sys::GGML_TYPE_Q5_K);
    pub const Q6_K: GgmlType = GgmlType(sys::GGML_TYPE_Q6_K);

    /// Parses a type name as ggml prints it (`q4_K`, `Q6_K`, `f32`, …), case-insensitively.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        (0..sys::GGML_TYPE_COUNT).map(GgmlType).find(|t| t.block_size() > 0 && t.name().eq_ignore_ascii_case(name))
    }

    /// ggml's name for the type (`q4_K`).
    pub fn name(self) -> &'static str {
        // SAFETY: ggml_type_name returns a pointer to a static string for any value
        // (a placeholder for unknown ones).
        unsafe { CStr::from_ptr(sys::ggml_type_name(self.0)) }.to_str().unwrap_or("?")
    }

    /// Elements per block (0 for removed types).
    pub fn block_size(self) -> i64 {
        // SAFETY: plain lookup in ggml's static type table.
        unsafe { sys::ggml_blck_size(self.0) }
    }

    /// Bytes of one row of `n` elements; `n` must be a multiple of the block size.
    pub fn row_size(self, n: i64) -> usize {
        assert!(n % self.block_size() == 0, "{} rows must be a multiple of {} long, not {n}", self.name(), self.block_size());
        // SAFETY: plain arithmetic on ggml's static type table.
        unsafe { sys::ggml_row_size(self.0, n) }
    }

    /// True if ggml can quantize f32 data into this type without an importance matrix.
    pub fn can_quantize(self) -> bool {
        // SAFETY: plain lookups in ggml's static type tables.
        let requires_imatrix = unsafe { sys::ggml_quantize_requires_imatrix(self.0) };
        self == GgmlType::F32 || (self.block_size() > 0 && !requires_imatrix)
    }
}

/// Quantizes `src` (whole rows of `n_per_row` f32 values) into `dst` with
/// ggml's reference quantizer for `ty`; F32 is copied. Returns the bytes written.
pub fn quantize_rows(ty: GgmlType, src: &[f32], n_per_row: i64, dst: &mut [u8]) -> usize {
    let n_per_row_us = usize::try_from(n_per_row).expect("positive row length");
    assert!(n_per_row_us > 0 && src.len() % n_per_row_us == 0, "quantize_rows: partial row");
    let nrows = (src.len() / n_per_row_us) as i64;
    let need = ty.row_size(n_per_row) * nrows as usize;
    assert!(dst.len() >= need, "quantize_rows: destination holds {} bytes, needs {need}", dst.len());
    if ty == GgmlType::F32 {
        for (d, s) in dst.chunks_exact_mut(4).zip(src) {
            d.copy_from_slice(&s.to_le_bytes());
        }
        return need;
    }
    assert!(ty.can_quantize(), "ggml cannot quantize to {} without an importance matrix", ty.name());
    // SAFETY: src holds nrows * n_per_row floats and dst at least the quantized
    // size of those rows (both checked above); no importance matrix is passed,
    // which ggml accepts for every type where can_quantize() holds.
    unsafe {
        sys::ggml_quantize_chunk(ty.0, src.as_ptr(), dst.as_mut_ptr().cast(), 0, nrows, n_per_row, std::ptr::null())
    }
}
