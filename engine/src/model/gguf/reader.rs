//! The GGUF container: header, metadata, tensor infos and the memory-mapped data section.
//!
//! Layout (little-endian; v2 and v3 are identical here, v3 only added big-endian files, which
//! are refused): `"GGUF"`, `version: u32`, `tensor_count: u64`, `kv_count: u64`, then `kv_count`
//! metadata entries `(key: string, type: u32, value)`, then `tensor_count` infos
//! `(name: string, n_dims: u32, dims: [u64; n_dims], type: u32, offset: u64)`, then padding to
//! `general.alignment` (default 32), then the data. A string is `len: u64` then UTF-8 bytes.
//! `dims` lists ggml's `ne`, innermost first: `ne[0]` is the row length.
//!
//! Invariants once [`GgufFile`] exists: every tensor's type is known, its element count is a
//! whole number of blocks per row, its offset is aligned, and its bytes lie inside the file.
//! Counts are checked against the bytes left before anything is allocated for them.

use std::collections::HashMap;
use std::path::Path;

use super::dequant::{dequantize, DequantError, GgmlType};
use super::{GgufError, Result};

/// Metadata value types (`enum gguf_type`).
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// ggml's limit on tensor rank.
pub const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted (llama.cpp writes none deeper than 1).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Elements all of the declared type (`elem_type` is kept so empty arrays stay typed).
    Array {
        elem_type: u32,
        items: Vec<MetaValue>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The GGUF name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array { .. } => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }

    /// Any integer type as i128 (so that u64 and i64 both fit); `None` for other types.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// f32 or f64 (narrowed) as f32; `None` for other types.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }
}

/// A tensor's description from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne`, innermost first (`dims[0]` is the row length). Reverse it for a HF shape.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape in row-major (Hugging Face) order: `dims` reversed.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file whose tensor data stays memory-mapped until dequantized.
///
/// The image is a [`bytes::Bytes`] (the map, or the bytes handed to [`GgufFile::from_bytes`]),
/// so that a tensor used as it lies ([`GgufFile::tensor_shared`]) keeps the map alive after this
/// file is dropped, without copying.
pub struct GgufFile {
    bytes: bytes::Bytes,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("bytes", &self.bytes.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked little-endian reader over the header.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_size` bytes, refused if the rest of the file could
    /// not hold that many (so no allocation is sized by an absurd count).
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<u64> {
        let n = self.u64(what)?;
        let limit = self.remaining() / min_size.max(1);
        if n > limit {
            return Err(GgufError::TooLarge { what: what(), value: n, limit });
        }
        Ok(n)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what() })
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match ty {
            T_U8 => MetaValue::U8(u8::from_le_bytes(self.array(&what)?)),
            T_I8 => MetaValue::I8(i8::from_le_bytes(self.array(&what)?)),
            T_U16 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            T_I16 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            T_U32 => MetaValue::U32(u32::from_le_bytes(self.array(&what)?)),
            T_I32 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            T_F32 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            T_BOOL => MetaValue::Bool(self.array::<1>(&what)?[0] != 0),
            T_STRING => MetaValue::String(self.string(&what)?),
            T_U64 => MetaValue::U64(u64::from_le_bytes(self.array(&what)?)),
            T_I64 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            T_F64 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep { key: key.to_string(), limit: MAX_ARRAY_DEPTH });
                }
                let elem_type = self.u32(&what)?;
                let min_size = match elem_type {
                    T_U8 | T_I8 | T_BOOL => 1,
                    T_U16 | T_I16 => 2,
                    T_U32 | T_I32 | T_F32 => 4,
                    T_U64 | T_I64 | T_F64 | T_STRING => 8,
                    T_ARRAY => 12,
                    ty => return Err(GgufError::UnknownValueType { key: key.to_string(), ty }),
                };
                let n = self.count(min_size, &|| format!("array length of metadata key {key:?}"))?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_type, key, depth + 1)?);
                }
                MetaValue::Array { elem_type, items }
            }
            ty => return Err(GgufError::UnknownValueType { key: key.to_string(), ty }),
        })
    }
}

/// A file map that several owners hold: the parsed file's bytes, and [`GgufFile::open`] to
/// advise on its pages once parsing is done.
struct SharedMap(std::sync::Arc<memmap2::Mmap>);

impl AsRef<[u8]> for SharedMap {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. Like every mmap-based model loader (llama.cpp's
        // included) we assume the file is not truncated or rewritten while it is mapped, which
        // is for the life of the weights that use it in place ([`GgufFile::tensor_shared`]);
        // every offset is validated against the mapped length before use.
        let map = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?);
        let parsed = Self::parse(bytes::Bytes::from_owner(SharedMap(map.clone())))?;
        // The header (metadata: the vocabulary, merges, chat template; 1.7 MB of SmolLM2's
        // file) has been parsed into owned values and is not read again; its pages leave this
        // process's resident set, which parsing put them in. Whole pages only, below the data.
        let header = (parsed.data_start as usize).min(map.len()) / 4096 * 4096;
        if header > 0 {
            // SAFETY: the map is a shared, read-only file mapping: dropping its pages changes no
            // byte anyone reads (a later read faults them in again from the file). Advisory:
            // a failure leaves them resident, nothing more.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, 0, header) };
        }
        Ok(parsed)
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(bytes::Bytes::from(bytes))
    }

    fn parse(bytes: bytes::Bytes) -> Result<Self> {
        let buf = &bytes[..];
        let len = buf.len() as u64;
        let mut c = Cursor { buf, pos: 0 };
        let magic: [u8; 4] = c.array(&|| "magic".into())?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            let hint = match version {
                1 => " (GGUF v1 used 32-bit counts; re-convert the model)",
                v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => " (this looks like a big-endian GGUF)",
                _ => "",
            };
            return Err(GgufError::UnsupportedVersion { version, hint });
        }
        // Smallest tensor info: empty name (8) + n_dims (4) + type (4) + offset (8), no dims.
        let n_tensors = c.count(24, &|| "tensor count".into())?;
        // Smallest metadata entry: empty key (8) + type (4) + one-byte value (1).
        let n_kv = c.count(13, &|| "metadata count".into())?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("type of metadata key {key:?}"))?;
            let value = c.value(ty, &key, 0)?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { key });
            }
            metadata.push((key, value));
        }
        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_int() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 30 => a as u64,
                Some(a) => return Err(GgufError::BadAlignment { alignment: a.clamp(0, u64::MAX as i128) as u64 }),
                None => {
                    return Err(GgufError::WrongType {
                        key: "general.alignment".into(),
                        expected: "integer",
                        found: v.type_name().into(),
                    })
                }
            },
        };

        let mut infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("name of tensor #{i}"))?;
            let what = || format!("info of tensor {name:?}");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadShape {
                    name,
                    dims: vec![],
                    reason: format!("{n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let ty_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            infos.push((name, dims, ty_id, offset));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = Vec::with_capacity(infos.len());
        let mut tensor_index = HashMap::with_capacity(infos.len());
        for (name, dims, ty_id, offset) in infos {
            let info = validate_tensor(name, dims, ty_id, offset, alignment, data_start, len)?;
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { name: info.name });
            }
            tensors.push(info);
        }
        Ok(Self { bytes, version, alignment, data_start, metadata, key_index, tensors, tensor_index })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name` (GGUF naming), if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor of this file (in bounds by construction).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_start + info.offset) as usize;
        &self.bytes[start..start + info.n_bytes as usize]
    }

    /// [`GgufFile::tensor_bytes`] without a copy: a handle on the same bytes that keeps the file
    /// mapped for as long as it lives.
    pub fn tensor_shared(&self, info: &TensorInfo) -> bytes::Bytes {
        let start = (self.data_start + info.offset) as usize;
        self.bytes.slice(start..start + info.n_bytes as usize)
    }

    /// Tensor `name` (GGUF naming) dequantized to f32, in ggml order (row-major over the
    /// reversed dims).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor { hf_name: name.to_string(), gguf_name: name.to_string() })?;
        dequantize(info.ggml_type, self.tensor_bytes(info), info.n_elements as usize).map_err(|e| match e {
            DequantError::Unsupported => {
                GgufError::UnsupportedTensorType { name: info.name.clone(), ty: info.ggml_type }
            }
            DequantError::BadLength { n, bytes } => GgufError::BadShape {
                name: info.name.clone(),
                dims: info.dims.clone(),
                reason: format!("{n} values do not fill {bytes} bytes"),
            },
        })
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&'s MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| GgufError::WrongType {
                key: key.to_string(),
                expected,
                found: v.type_name().to_string(),
            }),
        }
    }

    /// An unsigned integer of any width; absent is `Ok(None)`, another type or a negative
    /// value is an error naming the key.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "non-negative integer", |v| v.as_int().and_then(|i| u64::try_from(i).ok()))
    }

    /// A float (f32, or f64 narrowed).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "float", MetaValue::as_f32)
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "bool", |v| match v {
            MetaValue::Bool(b) => Some(*b),
            _ => None,
        })
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "string", |v| match v {
            MetaValue::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// An array whose elements all convert with `f`.
    pub fn get_array<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        f: impl Fn(&'s MetaValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        self.typed(key, expected, |v| match v {
            MetaValue::Array { items, .. } => items.iter().map(&f).collect(),
            _ => None,
        })
    }
}

fn validate_tensor(
    name: String,
    dims: Vec<u64>,
    ty_id: u32,
    offset: u64,
    alignment: u64,
    data_start: u64,
    len: u64,
) -> Result<TensorInfo> {
    let Some(ggml_type) = GgmlType::from_u32(ty_id) else {
        return Err(GgufError::UnknownTensorType { name, ty: ty_id });
    };
    let bad = |name: String, dims: Vec<u64>, reason: String| GgufError::BadShape { name, dims, reason };
    let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
    let Some(n_elements) = n_elements else {
        return Err(bad(name, dims, "element count overflows".into()));
    };
    if dims.contains(&0) {
        return Err(bad(name, dims, "a dimension is 0".into()));
    }
    let (block, size) = ggml_type.block_layout();
    if !dims[0].is_multiple_of(block as u64) {
        return Err(bad(name, dims, format!("row length is not a multiple of {ggml_type}'s block of {block}")));
    }
    let Some(n_bytes) = (n_elements / block as u64).checked_mul(size as u64) else {
        return Err(bad(name, dims, "byte size overflows".into()));
    };
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedTensor { name, offset, alignment });
    }
    let start = data_start.checked_add(offset);
    let end = start.and_then(|s| s.checked_add(n_bytes));
    match (start, end) {
        (Some(_), Some(end)) if end <= len => Ok(TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes }),
        _ => Err(GgufError::TensorOutOfBounds {
            name,
            start: start.unwrap_or(u64::MAX),
            end: end.unwrap_or(u64::MAX),
            len,
        }),
    }
}
