//! A GGUF writer: images built in memory (`cleave quantize`'s output, and synthetic files for tests,
//! well-formed or deliberately broken: `offset_overrides` misplaces tensors on purpose).

use super::dequant::GgmlType;
use super::reader::MetaValue;

/// Builder for a GGUF image in memory.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, MetaValue)>,
    /// name, dims (ggml order), type id, data.
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    /// Replaces the computed offset of tensor `i` in the header.
    pub offset_overrides: Vec<(usize, u64)>,
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array { .. } => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend(x.to_le_bytes()),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array { elem_type, items } => {
            out.extend(elem_type.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

/// A string array value.
pub fn strs<S: AsRef<str>>(items: &[S]) -> MetaValue {
    MetaValue::Array { elem_type: 8, items: items.iter().map(|s| MetaValue::String(s.as_ref().to_string())).collect() }
}

/// Little-endian f32 bytes.
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        Self { version: 3, alignment: 32, kvs: Vec::new(), tensors: Vec::new(), offset_overrides: Vec::new() }
    }

    pub fn kv(mut self, key: &str, v: MetaValue) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    pub fn tensor(self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensor_raw(name, dims, ty.id(), data)
    }

    pub fn tensor_raw(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// An f32 tensor with HF shape `shape` (written with ggml's reversed dims).
    pub fn f32_tensor(self, name: &str, shape: &[usize], data: &[f32]) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "{name}");
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensor(name, &dims, GgmlType::F32, f32_bytes(data))
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let align = |x: u64| x.div_ceil(self.alignment) * self.alignment;
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (i, (name, dims, ty, data)) in self.tensors.iter().enumerate() {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            let o = self.offset_overrides.iter().find(|(j, _)| *j == i).map_or(offset, |&(_, o)| o);
            out.extend(o.to_le_bytes());
            offsets.push(offset);
            offset = align(offset + data.len() as u64);
        }
        out.resize(align(out.len() as u64) as usize, 0);
        let start = out.len();
        for ((_, _, _, data), o) in self.tensors.iter().zip(offsets) {
            out.resize(start + o as usize, 0);
            out.extend(data);
        }
        out
    }
}
