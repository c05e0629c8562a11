//! GGUF metadata through ggml's own gguf API: reading a file's keys and tensor
//! table, and building the metadata of a file whose tensor data the caller
//! streams out itself.

use crate::engine::ffi::ggml::GgmlType;
use crate::engine::ffi::sys;
use crate::error::{Error, Result};
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Array),
}

/// A GGUF array value (ggml does not accept nested arrays).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    Str(Vec<String>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor of a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Elements per dimension (ggml order, unused dimensions are 1).
    pub ne: [i64; 4],
    /// Offset of the tensor's data from the start of the file.
    pub offset: u64,
    /// Bytes of tensor data.
    pub size: u64,
}

/// An open GGUF file's metadata (keys and tensor table; no tensor data).
pub struct Gguf {
    ctx: NonNull<sys::gguf_context>,
    path: PathBuf,
}

// SAFETY: the context is owned exclusively by this value and only read through &self.
unsafe impl Send for Gguf {}

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: ctx came from gguf_init_* and is freed exactly once, here.
        unsafe { sys::gguf_free(self.ctx.as_ptr()) }
    }
}

fn c_string(s: &str) -> CString {
    CString::new(s).unwrap_or_else(|_| panic!("GGUF key or name {s:?} contains NUL"))
}

/// Converts a C string owned by ggml into an owned Rust string.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string valid for this call.
unsafe fn owned_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-NULL and NUL-terminated per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Gguf {
    /// Reads the metadata of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Gguf> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io("cannot open", path, e))?;
        if !meta.is_file() {
            return Err(Error::gguf(path, "not a regular file"));
        }
        let cpath = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::gguf(path, "path contains NUL"))?;
        let params = sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() };
        // SAFETY: cpath is a valid C string; with no_alloc and a NULL ctx, ggml
        // reads only the metadata and owns nothing of ours.
        let ctx = unsafe { sys::gguf_init_from_file(cpath.as_ptr(), params) };
        let ctx = NonNull::new(ctx).ok_or_else(|| Error::gguf(path, "not a valid GGUF file (ggml's reader rejected it)"))?;
        Ok(Gguf { ctx, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn raw(&self) -> *const sys::gguf_context {
        self.ctx.as_ptr()
    }

    /// Offset of the tensor data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        // SAFETY: valid context.
        unsafe { sys::gguf_get_data_offset(self.raw()) as u64 }
    }

    pub fn alignment(&self) -> u64 {
        // SAFETY: valid context.
        unsafe { sys::gguf_get_alignment(self.raw()) as u64 }
    }

    /// All keys, in file order.
    pub fn keys(&self) -> Vec<String> {
        // SAFETY: valid context; ids are within [0, n_kv).
        unsafe { (0..sys::gguf_get_n_kv(self.raw())).map(|i| owned_str(sys::gguf_get_key(self.raw(), i))).collect() }
    }

    /// The value of `key`, or None if the file does not have it.
    pub fn get(&self, key: &str) -> Option<Value> {
        let ckey = c_string(key);
        // SAFETY: valid context and C string.
        let id = unsafe { sys::gguf_find_key(self.raw(), ckey.as_ptr()) };
        (id >= 0).then(|| self.value(id))
    }

    /// `general.architecture`, the prefix of every model key (`qwen35moe`,
    /// `deepseek2`, …), or None where the file has none or it is not text.
    pub fn architecture(&self) -> Option<String> {
        match self.get("general.architecture") {
            Some(Value::Str(arch)) => Some(arch),
            _ => None,
        }
    }

    /// The whole number `{architecture}.{key}` (`expert_used_count`,
    /// `context_length`, `ssm.state_size`, …), or None where the file has no
    /// architecture, no such key, or a value that is not a whole number.
    pub fn arch_u64(&self, key: &str) -> Option<u64> {
        self.get(&format!("{}.{key}", self.architecture()?)).and_then(|v| v.as_u64())
    }

    /// Reads key `id`, dispatching on its stored type (ggml asserts the exact type).
    fn value(&self, id: i64) -> Value {
        let ctx = self.raw();
        // SAFETY: id is a valid key id of ctx, and every getter below is called
        // only for the type gguf_get_kv_type reports; array data pointers are
        // valid for gguf_get_arr_n elements of the reported element type.
        unsafe {
            match sys::gguf_get_kv_type(ctx, id) {
                sys::GGUF_TYPE_UINT8 => Value::U8(sys::gguf_get_val_u8(ctx, id)),
                sys::GGUF_TYPE_INT8 => Value::I8(sys::gguf_get_val_i8(ctx, id)),
                sys::GGUF_TYPE_UINT16 => Value::U16(sys::gguf_get_val_u16(ctx, id)),
                sys::GGUF_TYPE_INT16 => Value::I16(sys::gguf_get_val_i16(ctx, id)),
                sys::GGUF_TYPE_UINT32 => Value::U32(sys::gguf_get_val_u32(ctx, id)),
                sys::GGUF_TYPE_INT32 => Value::I32(sys::gguf_get_val_i32(ctx, id)),
                sys::GGUF_TYPE_UINT64 => Value::U64(sys::gguf_get_val_u64(ctx, id)),
                sys::GGUF_TYPE_INT64 => Value::I64(sys::gguf_get_val_i64(ctx, id)),
                sys::GGUF_TYPE_FLOAT32 => Value::F32(sys::gguf_get_val_f32(ctx, id)),
                sys::GGUF_TYPE_FLOAT64 => Value::F64(sys::gguf_get_val_f64(ctx, id)),
                sys::GGUF_TYPE_BOOL => Value::Bool(sys::gguf_get_val_bool(ctx, id)),
                sys::GGUF_TYPE_STRING => Value::Str(owned_str(sys::gguf_get_val_str(ctx, id))),
                sys::GGUF_TYPE_ARRAY => {
                    let n = sys::gguf_get_arr_n(ctx, id);
                    let et = sys::gguf_get_arr_type(ctx, id);
                    if et == sys::GGUF_TYPE_STRING {
                        return Value::Array(Array::Str((0..n).map(|i| owned_str(sys::gguf_get_arr_str(ctx, id, i))).collect()));
                    }
                    let data = sys::gguf_get_arr_data(ctx, id);
                    macro_rules! arr {
                        ($variant:ident, $t:ty) => {
                            Array::$variant(std::slice::from_raw_parts(data.cast::<$t>(), n).to_vec())
                        };
                    }
                    Value::Array(match et {
                        sys::GGUF_TYPE_UINT8 => arr!(U8, u8),
                        sys::GGUF_TYPE_INT8 => arr!(I8, i8),
                        sys::GGUF_TYPE_UINT16 => arr!(U16, u16),
                        sys::GGUF_TYPE_INT16 => arr!(I16, i16),
                        sys::GGUF_TYPE_UINT32 => arr!(U32, u32),
                        sys::GGUF_TYPE_INT32 => arr!(I32, i32),
                        sys::GGUF_TYPE_UINT64 => arr!(U64, u64),
                        sys::GGUF_TYPE_INT64 => arr!(I64, i64),
                        sys::GGUF_TYPE_FLOAT32 => arr!(F32, f32),
                        sys::GGUF_TYPE_FLOAT64 => arr!(F64, f64),
                        // BOOL is one byte per element in GGUF.
                        sys::GGUF_TYPE_BOOL => Array::Bool(std::slice::from_raw_parts(data.cast::<u8>(), n).iter().map(|&b| b != 0).collect()),
                        other => unreachable!("ggml accepted a GGUF array of unknown element type {other}"),
                    })
                }
                other => unreachable!("ggml accepted a GGUF value of unknown type {other}"),
            }
        }
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let ctx = self.raw();
        let base = self.data_offset();
        // SAFETY: valid context; ids are within [0, n_tensors); ne points to
        // GGML_MAX_DIMS (4) elements.
        unsafe {
            (0..sys::gguf_get_n_tensors(ctx))
                .map(|i| {
                    let ne = std::slice::from_raw_parts(sys::gguf_get_tensor_ne(ctx, i), 4);
                    TensorInfo {
                        name: owned_str(sys::gguf_get_tensor_name(ctx, i)),
                        ty: GgmlType(sys::gguf_get_tensor_type(ctx, i)),
                        ne: [ne[0], ne[1], ne[2], ne[3]],
                        offset: base + sys::gguf_get_tensor_offset(ctx, i) as u64,
                        size: sys::gguf_get_tensor_size(ctx, i) as u64,
                    }
                })
                .collect()
        }
    }
}

/// The metadata of a GGUF file being written: keys and tensor descriptors.
/// The caller writes [`GgufBuilder::meta_bytes`] and then each tensor's data
/// at its [`GgufBuilder::tensor_offset`] (relative to the end of the metadata),
/// so a file of any size is written without holding its data.
pub struct GgufBuilder {
    ctx: NonNull<sys::gguf_context>,
    /// ggml context holding the tensor descriptors (no data).
    tensors: NonNull<sys::ggml_context>,
    names: Vec<String>,
}

impl Drop for GgufBuilder {
    fn drop(&mut self) {
        // SAFETY: both were created in new() and are freed exactly once, here.
        unsafe {
            sys::gguf_free(self.ctx.as_ptr());
            sys::ggml_free(self.tensors.as_ptr());
        }
    }
}

impl GgufBuilder {
    /// An empty file with room for `max_tensors` tensor descriptors.
    pub fn new(max_tensors: usize) -> GgufBuilder {
        // SAFETY: gguf_init_empty has no preconditions; ggml_init with no_alloc
        // only reserves room for tensor structs (overhead per tensor).
        unsafe {
            let ctx = NonNull::new(sys::gguf_init_empty()).expect("gguf_init_empty");
            let params = sys::ggml_init_params { mem_size: (max_tensors + 1) * sys::ggml_tensor_overhead(), mem_buffer: std::ptr::null_mut(), no_alloc: true };
            let tensors = NonNull::new(sys::ggml_init(params)).expect("ggml_init");
            GgufBuilder { ctx, tensors, names: Vec::new() }
        }
    }

    /// Sets `key` to `value`, replacing any earlier value.
    pub fn set(&mut self, key: &str, value: &Value) {
        let k = c_string(key);
        let ctx = self.ctx.as_ptr();
        // SAFETY: ctx is valid; every pointer passed stays alive for the call,
        // and ggml copies the data it is given.
        unsafe {
            match value {
                Value::U8(v) => sys::gguf_set_val_u8(ctx, k.as_ptr(), *v),
                Value::I8(v) => sys::gguf_set_val_i8(ctx, k.as_ptr(), *v),
                Value::U16(v) => sys::gguf_set_val_u16(ctx, k.as_ptr(), *v),
                Value::I16(v) => sys::gguf_set_val_i16(ctx, k.as_ptr(), *v),
                Value::U32(v) => sys::gguf_set_val_u32(ctx, k.as_ptr(), *v),
                Value::I32(v) => sys::gguf_set_val_i32(ctx, k.as_ptr(), *v),
                Value::U64(v) => sys::gguf_set_val_u64(ctx, k.as_ptr(), *v),
                Value::I64(v) => sys::gguf_set_val_i64(ctx, k.as_ptr(), *v),
                Value::F32(v) => sys::gguf_set_val_f32(ctx, k.as_ptr(), *v),
                Value::F64(v) => sys::gguf_set_val_f64(ctx, k.as_ptr(), *v),
                Value::Bool(v) => sys::gguf_set_val_bool(ctx, k.as_ptr(), *v),
                Value::Str(s) => sys::gguf_set_val_str(ctx, k.as_ptr(), c_string(s).as_ptr()),
                Value::Array(Array::Str(v)) => {
                    let owned: Vec<CString> = v.iter().map(|s| c_string(s)).collect();
                    let mut ptrs: Vec<*const c_char> = owned.iter().map(|s| s.as_ptr()).collect();
                    sys::gguf_set_arr_str(ctx, k.as_ptr(), ptrs.as_mut_ptr(), ptrs.len());
                }
                Value::Array(Array::Bool(v)) => {
                    let bytes: Vec<u8> = v.iter().map(|&b| b as u8).collect();
                    sys::gguf_set_arr_data(ctx, k.as_ptr(), sys::GGUF_TYPE_BOOL, bytes.as_ptr().cast(), bytes.len());
                }
                Value::Array(a) => {
                    macro_rules! set_arr {
                        ($v:expr, $t:expr) => {
                            sys::gguf_set_arr_data(ctx, k.as_ptr(), $t, $v.as_ptr().cast(), $v.len())
                        };
                    }
                    match a {
                        Array::U8(v) => set_arr!(v, sys::GGUF_TYPE_UINT8),
                        Array::I8(v) => set_arr!(v, sys::GGUF_TYPE_INT8),
                        Array::U16(v) => set_arr!(v, sys::GGUF_TYPE_UINT16),
                        Array::I16(v) => set_arr!(v, sys::GGUF_TYPE_INT16),
                        Array::U32(v) => set_arr!(v, sys::GGUF_TYPE_UINT32),
                        Array::I32(v) => set_arr!(v, sys::GGUF_TYPE_INT32),
                        Array::U64(v) => set_arr!(v, sys::GGUF_TYPE_UINT64),
                        Array::I64(v) => set_arr!(v, sys::GGUF_TYPE_INT64),
                        Array::F32(v) => set_arr!(v, sys::GGUF_TYPE_FLOAT32),
                        Array::F64(v) => set_arr!(v, sys::GGUF_TYPE_FLOAT64),
                        Array::Str(_) | Array::Bool(_) => unreachable!("handled above"),
                    }
                }
            }
        }
    }

    /// Adds a tensor descriptor; its data offset follows the previous tensor's, padded.
    pub fn add_tensor(&mut self, name: &str, ty: GgmlType, ne: &[i64]) {
        assert!((1..=4).contains(&ne.len()), "tensor {name}: {} dimensions", ne.len());
        assert!(ne[0] % ty.block_size() == 0, "tensor {name}: row of {} is not a multiple of {}'s block", ne[0], ty.name());
        let cname = c_string(name);
        // SAFETY: the ggml context was sized for the tensors added; ne holds
        // ne.len() dimensions; gguf_add_tensor copies the descriptor (data NULL).
        unsafe {
            let t = sys::ggml_new_tensor(self.tensors.as_ptr(), ty.0, ne.len() as i32, ne.as_ptr());
            assert!(!t.is_null(), "ggml_new_tensor({name}) failed: context full");
            sys::ggml_set_name(t, cname.as_ptr());
            sys::gguf_add_tensor(self.ctx.as_ptr(), t);
        }
        self.names.push(name.to_string());
    }

    /// Tensor `i`'s data offset, relative to the end of the metadata.
    pub fn tensor_offset(&self, i: usize) -> u64 {
        assert!(i < self.names.len(), "tensor index {i} of {}", self.names.len());
        // SAFETY: valid context; i is below the number of tensors added (asserted).
        unsafe { sys::gguf_get_tensor_offset(self.ctx.as_ptr(), i as i64) as u64 }
    }

    pub fn alignment(&self) -> u64 {
        // SAFETY: valid context.
        unsafe { sys::gguf_get_alignment(self.ctx.as_ptr()) as u64 }
    }

    /// The serialized metadata (header, keys, tensor infos, padding to alignment).
    pub fn meta_bytes(&self) -> Vec<u8> {
        // SAFETY: valid context; the buffer is sized by gguf_get_meta_size.
        unsafe {
            let n = sys::gguf_get_meta_size(self.ctx.as_ptr());
            let mut buf = vec![0u8; n];
            sys::gguf_get_meta_data(self.ctx.as_ptr(), buf.as_mut_ptr().cast());
            buf
        }
    }
}
