//! [`GgufWriter`]: builds a GGUF v3 (or v2) file from metadata and raw tensor bytes, for tools
//! and for tests that need model files. It checks what the reader would reject (duplicate
//! names, bad shapes, data of the wrong length, bad alignment, arrays nested too deep) when
//! things are added, so a file it writes always reads back.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::metadata::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, Metadata};
use crate::reader::GGUF_MAGIC;
use crate::tensor::{MAX_DIMS, Shape, ShapeProblem, tensor_n_bytes};
use crate::types::GgmlType;
use crate::value::{MAX_ARRAY_DEPTH, Value, encode_string};

/// The GGUF version a writer emits. v2 and v3 share one layout (v3 only allows big-endian
/// files, which this crate never writes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GgufVersion {
    V2 = 2,
    #[default]
    V3 = 3,
}

struct PendingTensor<'data> {
    name: String,
    dtype: GgmlType,
    shape: Shape,
    /// Empty for a tensor declared with [`GgufWriter::declare_tensor`].
    data: Cow<'data, [u8]>,
    len: u64,
    lazy: bool,
}

/// Collects metadata and tensors, then writes them as one GGUF file. Tensor data may be
/// borrowed (`&'data [u8]`) or owned (`Vec<u8>`).
#[derive(Default)]
pub struct GgufWriter<'data> {
    version: GgufVersion,
    metadata: Metadata,
    tensors: Vec<PendingTensor<'data>>,
    tensor_names: HashSet<String>,
}

impl<'data> GgufWriter<'data> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer starting from existing metadata (e.g. another file's), validated as if each
    /// entry had been added with [`GgufWriter::add_metadata`].
    pub fn with_metadata(metadata: Metadata) -> Result<Self> {
        for (key, value) in metadata.iter() {
            validate_value(key, value)?;
        }
        Ok(Self {
            metadata,
            ..Self::default()
        })
    }

    pub fn set_version(&mut self, version: GgufVersion) {
        self.version = version;
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Appends a metadata entry; fails on a duplicate key or an invalid value.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let (key, value) = (key.into(), value.into());
        validate_value(&key, &value)?;
        self.metadata.push(key, value)
    }

    /// Sets a metadata entry, replacing an existing value in place. Returns the previous value.
    pub fn set_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<Option<Value>> {
        let (key, value) = (key.into(), value.into());
        validate_value(&key, &value)?;
        Ok(self.metadata.insert(key, value))
    }

    /// Sets `general.alignment` (a nonzero power of two).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        self.set_metadata(ALIGNMENT_KEY, alignment).map(drop)
    }

    /// The data alignment the file will use.
    pub fn alignment(&self) -> u64 {
        match self.metadata.get(ALIGNMENT_KEY) {
            Some(Value::U32(a)) => u64::from(*a),
            _ => DEFAULT_ALIGNMENT.into(),
        }
    }

    /// Adds a tensor of `dtype` with `shape` (ggml order, `shape[0]` is the row length) whose
    /// raw bytes (F32/F16 values or quantized blocks, little-endian) are `data`.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: GgmlType,
        shape: &[u64],
        data: impl Into<Cow<'data, [u8]>>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        if self.tensor_names.contains(&name) {
            return Err(GgufError::DuplicateTensorName { tensor: name });
        }
        let invalid = |reason: String| GgufError::InvalidTensor {
            tensor: name.clone(),
            reason,
        };
        let shape = Shape::new(shape).ok_or_else(|| {
            invalid(format!(
                "{} dimensions (must be 1..={MAX_DIMS})",
                shape.len()
            ))
        })?;
        let expected = tensor_n_bytes(dtype, &shape).map_err(|problem| match problem {
            ShapeProblem::Overflow => invalid(format!("{dtype} {shape} overflows u64")),
            ShapeProblem::RowNotWholeBlocks => invalid(format!(
                "row length {} is not a multiple of the {dtype} block size {}",
                shape[0],
                dtype.block_size()
            )),
        })?;
        if data.len() as u64 != expected {
            return Err(GgufError::TensorDataSize {
                tensor: name,
                expected,
                actual: data.len() as u64,
            });
        }
        self.tensor_names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dtype,
            shape,
            len: expected,
            data,
            lazy: false,
        });
        Ok(())
    }

    /// Declares a tensor whose bytes are produced while writing, by
    /// [`GgufWriter::write_streaming`] — for files too large to hold in memory.
    pub fn declare_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: GgmlType,
        shape: &[u64],
    ) -> Result<()> {
        let name = name.into();
        if self.tensor_names.contains(&name) {
            return Err(GgufError::DuplicateTensorName { tensor: name });
        }
        let invalid = |reason: String| GgufError::InvalidTensor {
            tensor: name.clone(),
            reason,
        };
        let shape = Shape::new(shape).ok_or_else(|| {
            invalid(format!(
                "{} dimensions (must be 1..={MAX_DIMS})",
                shape.len()
            ))
        })?;
        let len = tensor_n_bytes(dtype, &shape).map_err(|p| match p {
            ShapeProblem::Overflow => invalid(format!("{dtype} {shape} overflows u64")),
            ShapeProblem::RowNotWholeBlocks => invalid(format!(
                "row length {} is not a multiple of the {dtype} block size",
                shape[0]
            )),
        })?;
        self.tensor_names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dtype,
            shape,
            data: Cow::Borrowed(&[]),
            len,
            lazy: true,
        });
        Ok(())
    }

    /// Writes the file to `path`, asking `fill(name, dtype, shape, out)` for the bytes of every
    /// declared tensor in order (it must produce exactly the tensor's size).
    pub fn write_streaming(
        &self,
        path: impl AsRef<Path>,
        mut fill: impl FnMut(&str, GgmlType, &[u64], &mut Vec<u8>),
    ) -> Result<u64> {
        let path = path.as_ref();
        let io = |e| GgufError::io(path, e);
        let file = File::create(path).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 22, file);
        let alignment = self.alignment();
        let header = self.encode_header(alignment);
        out.write_all(&header).map_err(io)?;
        let mut written = header.len() as u64;
        let mut buf = Vec::new();
        for tensor in &self.tensors {
            let data: &[u8] = if tensor.lazy {
                buf.clear();
                fill(&tensor.name, tensor.dtype, &tensor.shape, &mut buf);
                if buf.len() as u64 != tensor.len {
                    return Err(GgufError::TensorDataSize {
                        tensor: tensor.name.clone(),
                        expected: tensor.len,
                        actual: buf.len() as u64,
                    });
                }
                &buf
            } else {
                &tensor.data
            };
            out.write_all(data).map_err(io)?;
            let padding = tensor.len.next_multiple_of(alignment) - tensor.len;
            write_zeros(&mut out, padding).map_err(io)?;
            written += tensor.len + padding;
        }
        out.flush().map_err(io)?;
        Ok(written)
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The size of the file [`GgufWriter::write_to`] (or `write_streaming`) would write, without
    /// writing it: header, then every tensor padded to the alignment.
    pub fn file_len(&self) -> u64 {
        let alignment = self.alignment();
        let data: u64 = self
            .tensors
            .iter()
            .map(|t| t.len.next_multiple_of(alignment))
            .sum();
        self.encode_header(alignment).len() as u64 + data
    }

    /// Writes the file to `out`; returns the number of bytes written.
    pub fn write_to<W: Write>(&self, mut out: W) -> Result<u64> {
        if let Some(t) = self.tensors.iter().find(|t| t.lazy) {
            return Err(GgufError::InvalidTensor {
                tensor: t.name.clone(),
                reason: "declared without data: write it with write_streaming".into(),
            });
        }
        let alignment = self.alignment();
        let header = self.encode_header(alignment);
        out.write_all(&header).map_err(GgufError::Write)?;
        let mut written = header.len() as u64;
        for tensor in &self.tensors {
            out.write_all(&tensor.data).map_err(GgufError::Write)?;
            let len = tensor.data.len() as u64;
            let padding = len.next_multiple_of(alignment) - len;
            write_zeros(&mut out, padding).map_err(GgufError::Write)?;
            written += len + padding;
        }
        out.flush().map_err(GgufError::Write)?;
        Ok(written)
    }

    /// Creates (or truncates) `path` and writes the file to it.
    pub fn write_to_path(&self, path: impl AsRef<Path>) -> Result<u64> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| GgufError::io(path, e))?;
        self.write_to(BufWriter::with_capacity(1 << 20, file))
            .map_err(|e| match e {
                GgufError::Write(error) => GgufError::io(path, error),
                other => other,
            })
    }

    /// Header, metadata, tensor infos, and padding up to the data section.
    fn encode_header(&self, alignment: u64) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&(self.version as u32).to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in self.metadata.iter() {
            encode_string(key, &mut out);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            value.encode(&mut out);
        }
        let mut offset_in_data = 0u64;
        for tensor in &self.tensors {
            encode_string(&tensor.name, &mut out);
            out.extend_from_slice(&(tensor.shape.len() as u32).to_le_bytes());
            for &dim in tensor.shape.iter() {
                out.extend_from_slice(&dim.to_le_bytes());
            }
            out.extend_from_slice(&tensor.dtype.id().to_le_bytes());
            out.extend_from_slice(&offset_in_data.to_le_bytes());
            offset_in_data += tensor.len.next_multiple_of(alignment);
        }
        let data_start = (out.len() as u64).next_multiple_of(alignment);
        out.resize(data_start as usize, 0);
        out
    }
}

fn write_zeros(out: &mut impl Write, mut n: u64) -> std::io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let chunk = n.min(ZEROS.len() as u64) as usize;
        out.write_all(&ZEROS[..chunk])?;
        n -= chunk as u64;
    }
    Ok(())
}

/// What the reader would reject: a bad `general.alignment`, arrays nested too deep.
fn validate_value(key: &str, value: &Value) -> Result<()> {
    let invalid = |reason: String| {
        Err(GgufError::InvalidValue {
            key: key.to_string(),
            reason,
        })
    };
    if key == ALIGNMENT_KEY {
        match value {
            Value::U32(a) if a.is_power_of_two() => {}
            other => {
                return invalid(format!(
                    "must be a u32 nonzero power of two, got {} {other:?}",
                    other.type_description()
                ));
            }
        }
    }
    if let Value::Array(array) = value
        && array.depth() > MAX_ARRAY_DEPTH
    {
        return invalid(format!(
            "arrays nested {} deep (at most {MAX_ARRAY_DEPTH})",
            array.depth()
        ));
    }
    Ok(())
}
