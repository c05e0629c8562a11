//! Safe access to the parts of ggml this crate uses directly: tensor types and
//! their sizes, and ggml's own quantizers.

use crate::engine::ffi::sys;
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
    pub const MXFP4: GgmlType = GgmlType(sys::GGML_TYPE_MXFP4);

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
    unsafe { sys::ggml_quantize_chunk(ty.0, src.as_ptr(), dst.as_mut_ptr().cast(), 0, nrows, n_per_row, std::ptr::null()) }
}

/// ggml's CPU kernels for multiplying rows of a weight type by activations:
/// the activation type (`vec_dot_type`), its quantizer and the dot product.
#[derive(Clone, Copy, Debug)]
pub struct DotKernels {
    pub weight: GgmlType,
    pub activation: GgmlType,
    from_float: sys::ggml_from_float_t,
    vec_dot: unsafe extern "C" fn(i32, *mut f32, usize, *const std::ffi::c_void, usize, *const std::ffi::c_void, usize, i32),
}

impl DotKernels {
    /// The kernels for weights of type `ty`, or None where ggml's CPU backend
    /// has no dot product for it.
    pub fn for_type(ty: GgmlType) -> Option<DotKernels> {
        if ty.0 >= sys::GGML_TYPE_COUNT || ty.block_size() == 0 {
            return None;
        }
        // SAFETY: ggml_cpu_init is idempotent and fills the tables read next;
        // ggml_get_type_traits_cpu returns a pointer into a static table for
        // any valid type.
        let (w, act) = unsafe {
            sys::ggml_cpu_init();
            let w = *sys::ggml_get_type_traits_cpu(ty.0);
            let act = *sys::ggml_get_type_traits_cpu(w.vec_dot_type);
            (w, act)
        };
        let vec_dot = w.vec_dot?;
        let activation = GgmlType(w.vec_dot_type);
        if activation != GgmlType::F32 && act.from_float.is_none() {
            return None;
        }
        Some(DotKernels { weight: ty, activation, from_float: act.from_float, vec_dot })
    }

    /// Bytes of one activation row of `n` values in the activation type.
    pub fn activation_row_bytes(&self, n: usize) -> usize {
        self.activation.row_size(n as i64)
    }

    /// Converts one activation row to the activation type, as ggml's
    /// mul_mat does before its dot products.
    pub fn convert_activation(&self, src: &[f32], dst: &mut [u8]) {
        let need = self.activation_row_bytes(src.len());
        assert!(dst.len() >= need, "activation buffer of {} bytes, need {need}", dst.len());
        match self.from_float {
            // SAFETY: src holds src.len() floats (a multiple of the block size,
            // checked by row_size) and dst at least their converted size.
            Some(f) => unsafe { f(src.as_ptr(), dst.as_mut_ptr().cast(), src.len() as i64) },
            None => {
                for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&s.to_ne_bytes());
                }
            }
        }
    }

    /// The dot product of one weight row (`n` values in the weight type) with
    /// one converted activation row.
    pub fn dot(&self, n: usize, weight_row: &[u8], activation: &[u8]) -> f32 {
        assert!(weight_row.len() >= self.weight.row_size(n as i64), "weight row too short");
        assert!(activation.len() >= self.activation_row_bytes(n), "activation row too short");
        let mut out = 0f32;
        // SAFETY: both rows hold n values of their types (checked above); one
        // row (nrc = 1) writes one float into `out`.
        unsafe { (self.vec_dot)(n as i32, &mut out, 0, weight_row.as_ptr().cast(), 0, activation.as_ptr().cast(), 0, 1) };
        out
    }
}

/// How llama.cpp lays out a weight in memory, which decides the kernels that
/// multiply it: the file's own layout, or one of ggml-cpu's repacked
/// (interleaved) layouts, which stock's loader converts some expert types
/// into (its CPU_REPACK buffer type) unless `--no-repack` is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    Plain,
    Repacked(Repacked),
}

/// One of ggml-cpu's repacked layouts, for experts of one shape: the
/// conversion of an expert into it (ggml-cpu's own repack routine) and the
/// GEMV that stock's repacked `mul_mat_id` multiplies it with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Repacked {
    kernel: i32,
    pub ty: GgmlType,
    /// Values per row.
    pub cols: i64,
    /// Rows of one expert.
    pub rows: i64,
}

impl WeightLayout {
    /// The layout stock gives `weight` (a routed-expert tensor, [cols, rows,
    /// experts]) in the buffer type `stock_buft` its loader chose for it,
    /// and a notice where sdq cannot reproduce that layout and multiplies
    /// the file's instead.
    ///
    /// # Safety
    /// `stock_buft` must be a buffer type ggml made (llama.cpp's loader
    /// passes the one it chose).
    pub unsafe fn of(weight: &sys::ggml_tensor, stock_buft: sys::ggml_backend_buffer_type_t) -> (WeightLayout, Option<String>) {
        // SAFETY: a pointer comparison with ggml-cpu's static buffer types.
        let kind = unsafe { sys::sdq_buft_layout(stock_buft) };
        if kind == sys::SDQ_BUFT_CPU as i32 {
            return (WeightLayout::Plain, None);
        }
        if kind != sys::SDQ_BUFT_CPU_REPACK as i32 {
            // SAFETY: buffer types name themselves with a static string.
            let name = unsafe { CStr::from_ptr(sys::ggml_backend_buft_name(stock_buft)) }.to_string_lossy();
            return (
                WeightLayout::Plain,
                Some(format!("stock would place the experts in buffer type {name}; sdq multiplies them with ggml-cpu's plain kernels")),
            );
        }
        // SAFETY: weight is a valid tensor descriptor; only its type and
        // shape are read.
        let kernel = unsafe { sys::sdq_repack_kernel(weight) };
        let ty = GgmlType(weight.type_);
        match kernel {
            -1 => (WeightLayout::Plain, None),
            k if k >= 0 => {
                let r = Repacked { kernel: k, ty, cols: weight.ne[0], rows: weight.ne[1] };
                let notice = (r.fast() == Some(false))
                    .then(|| format!("sdq's fast conversion into {} differs from ggml's; converting with ggml's own (slower)", r.name()));
                (WeightLayout::Repacked(r), notice)
            }
            _ => (
                WeightLayout::Plain,
                Some(format!(
                    "ggml-cpu repacks {} experts of {}x{} in a layout sdq does not know; sdq multiplies them with the plain kernels",
                    ty.name(),
                    weight.ne[0],
                    weight.ne[1]
                )),
            ),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            WeightLayout::Plain => "plain",
            WeightLayout::Repacked(r) => r.name(),
        }
    }
}

impl Repacked {
    /// ggml-cpu's name for the layout (`q4_K_8x8_q8_K`).
    pub fn name(&self) -> &'static str {
        // SAFETY: returns a static string for any id.
        unsafe { CStr::from_ptr(sys::sdq_repack_kernel_name(self.kernel)) }.to_str().unwrap_or("?")
    }

    /// Whether experts are converted with sdq's faster routine, which gave
    /// ggml's bytes for a sample (`Some(true)`), with ggml's because sdq's
    /// differed (`Some(false)`), or with ggml's, the only one (`None`).
    pub fn fast(&self) -> Option<bool> {
        // SAFETY: an atomic load in a static table, for any id.
        match unsafe { sys::sdq_repack_fast(self.kernel) } {
            1 => Some(true),
            -1 => Some(false),
            _ => None,
        }
    }

    /// Bytes of one expert (the same in both layouts).
    pub fn expert_bytes(&self) -> usize {
        self.ty.row_size(self.cols) * self.rows as usize
    }

    /// Converts one expert, read from the file into `data`, in place into
    /// this layout. False if ggml's repack routine refuses it.
    pub fn convert(&self, data: &mut [u8]) -> bool {
        assert_eq!(data.len(), self.expert_bytes(), "one {} expert is {} bytes", self.name(), self.expert_bytes());
        // SAFETY: data holds exactly one expert of rows × cols values of the
        // kernel's type (checked above), which the routine rewrites in place.
        unsafe { sys::sdq_repack_expert(self.kernel, self.cols, self.rows, data.as_mut_ptr().cast()) }
    }

    /// Multiplies one converted expert for routed rows `pairs` ((k, t)
    /// flattened): activation row t·b_ne1 + k mod b_ne1 of `acts` (rows of
    /// `act_row_bytes`) into the floats at out + k·nb1 + t·nb2, with the
    /// GEMV calls stock's repacked mul_mat_id makes with `nth` threads.
    ///
    /// # Safety
    /// `acts` must hold every activation row a pair names, converted to the
    /// weight's `vec_dot_type`; for every pair, `rows` floats at out + k·nb1
    /// + t·nb2 must be writable and written by no one else meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn mul(&self, data: &[u8], b_ne1: usize, acts: &[u8], act_row_bytes: usize, pairs: &[i32], out: *mut u8, nb1: usize, nb2: usize, nth: usize) {
        assert_eq!(data.len(), self.expert_bytes(), "one {} expert is {} bytes", self.name(), self.expert_bytes());
        // SAFETY: data is one converted expert (checked above); the rest is
        // this function's contract.
        unsafe {
            sys::sdq_repack_mul(
                self.kernel,
                self.cols,
                self.rows,
                data.as_ptr().cast(),
                b_ne1 as i64,
                acts.as_ptr().cast(),
                act_row_bytes,
                (pairs.len() / 2) as i64,
                pairs.as_ptr(),
                out.cast(),
                nb1,
                nb2,
                nth as i32,
            )
        }
    }
}
