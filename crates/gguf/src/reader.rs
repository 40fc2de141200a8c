//! [`GgufFile`]: one GGUF v2/v3 file, memory-mapped, parsed and validated up front so that every
//! later access (metadata, tensor index, zero-copy tensor bytes) is infallible. The parser never
//! panics on hostile input and never allocates from a count before checking the count against
//! the bytes left in the file.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::cursor::{Cursor, Field};
use crate::error::{GgufError, Result};
use crate::fingerprint::{Fingerprint, fingerprint_files};
use crate::metadata::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, Metadata};
use crate::tensor::{MAX_DIMS, Shape, ShapeProblem, TensorInfo, tensor_n_bytes};
use crate::types::GgmlType;
use crate::value::{Array, MAX_ARRAY_DEPTH, StringArray, Value, ValueType};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Smallest encoded metadata entry: key length (u64) + value type (u32) + a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Smallest encoded tensor info: name length (u64) + n_dims (u32) + one dim (u64) + type (u32)
/// + offset (u64).
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;
/// Counts are checked against the file size before use, but an in-memory `String` or
/// `TensorInfo` is larger than its smallest encoding, so up-front reservations are capped too;
/// vectors grow past this only as entries are actually parsed. 2^20 covers any real vocabulary.
const MAX_PREALLOCATED_ITEMS: usize = 1 << 20;
/// Likewise for the text of a string array, whose upper bound is the rest of the file.
const MAX_PREALLOCATED_TEXT: usize = 16 << 20;

/// Where a tensor's bytes live on disk, for readers that `pread` instead of touching the map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    pub path: Arc<Path>,
    /// Absolute byte offset in `path`.
    pub offset: u64,
    pub n_bytes: u64,
}

enum FileBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

/// One parsed and validated GGUF file.
pub struct GgufFile {
    path: Arc<Path>,
    bytes: FileBytes,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Memory-maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let len = file.metadata().map_err(|e| GgufError::io(path, e))?.len();
        // An empty file cannot be mapped; it is parsed (and rejected) like any short file.
        let bytes = if len == 0 {
            FileBytes::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. Like every mmap-based model loader, we rely on the
            // file not being truncated or rewritten while it is open; that would be a
            // user error outside the process's control (the kernel raises SIGBUS on truncation).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
            FileBytes::Mapped(map)
        };
        Self::from_file_bytes(path.into(), bytes)
    }

    /// Parses a GGUF image held in memory; `label` stands in for the path in errors.
    pub fn from_bytes(label: impl AsRef<Path>, bytes: Vec<u8>) -> Result<Self> {
        Self::from_file_bytes(label.as_ref().into(), FileBytes::Owned(bytes))
    }

    fn from_file_bytes(path: Arc<Path>, bytes: FileBytes) -> Result<Self> {
        let parsed = parse(&path, bytes.as_slice())?;
        let tensor_index = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            bytes,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            tensor_index,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path as a cheaply clonable handle (what [`TensorLocation`] carries).
    pub fn shared_path(&self) -> Arc<Path> {
        Arc::clone(&self.path)
    }

    /// GGUF format version: 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor index in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of tensor `name`, borrowed from the map.
    pub fn tensor_data(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).and_then(|info| self.data(info))
    }

    /// The bytes of `info`, borrowed from the map; `None` only for an info from another file
    /// whose range does not lie inside this one.
    pub fn data(&self, info: &TensorInfo) -> Option<&[u8]> {
        let start = usize::try_from(info.file_offset).ok()?;
        let len = usize::try_from(info.n_bytes).ok()?;
        self.bytes.as_slice().get(start..start.checked_add(len)?)
    }

    /// Where tensor `name` lives on disk.
    pub fn location(&self, name: &str) -> Option<TensorLocation> {
        self.tensor(name).map(|info| TensorLocation {
            path: self.shared_path(),
            offset: info.file_offset,
            n_bytes: info.n_bytes,
        })
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section; tensor offsets are relative to it.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// SHA-256 over this file's metadata and tensor index; equal to the fingerprint of a
    /// [`crate::GgufModel`] made of this one file.
    pub fn fingerprint(&self) -> Fingerprint {
        fingerprint_files([(self.metadata(), self.tensors())].into_iter())
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl FileBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Owned(bytes) => bytes,
        }
    }
}

struct Parsed {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut cur = Cursor::new(bytes, path);
    let magic = cur.array::<4>(Field::Magic)?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            path: path.into(),
            found: magic.to_vec(),
        });
    }
    let version = cur.u32(Field::Version)?;
    if !matches!(version, 2 | 3) {
        return Err(GgufError::UnsupportedVersion {
            path: path.into(),
            version,
        });
    }
    let tensor_count = cur.count(Field::TensorCount, MIN_TENSOR_INFO_BYTES)?;
    let kv_count = cur.count(Field::KvCount, MIN_KV_BYTES)?;

    let metadata = read_metadata(&mut cur, kv_count)?;
    let mut tensors = read_tensor_infos(&mut cur, tensor_count)?;

    let alignment = alignment_of(path, &metadata)?;
    let data_offset = cur.offset().next_multiple_of(alignment);
    place_tensors(
        path,
        &mut tensors,
        alignment,
        data_offset,
        bytes.len() as u64,
    )?;
    check_no_overlap(path, &tensors)?;
    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn read_metadata(cur: &mut Cursor<'_>, kv_count: usize) -> Result<Metadata> {
    let mut metadata = Metadata::with_capacity(kv_count.min(MAX_PREALLOCATED_ITEMS));
    for index in 0..kv_count as u64 {
        let key_offset = cur.offset();
        let key = cur.string(Field::Key { index })?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                path: cur.path.into(),
                offset: key_offset,
                key,
            });
        }
        let value_type = cur.value_type(Field::ValueType { key: &key })?;
        let value = read_value(cur, value_type, &key)?;
        metadata.insert(key, value);
    }
    Ok(metadata)
}

fn read_value(cur: &mut Cursor<'_>, value_type: ValueType, key: &str) -> Result<Value> {
    let field = Field::Value { key };
    Ok(match value_type {
        ValueType::U8 => Value::U8(cur.array::<1>(field)?[0]),
        ValueType::I8 => Value::I8(i8::from_le_bytes(cur.array(field)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(cur.array(field)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(cur.array(field)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(cur.array(field)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(cur.array(field)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(cur.array(field)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(cur.array(field)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(cur.array(field)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(cur.array(field)?)),
        ValueType::Bool => {
            let offset = cur.offset();
            Value::Bool(
                cur.bools(1, offset, field)?
                    .first()
                    .copied()
                    .unwrap_or_default(),
            )
        }
        ValueType::String => Value::String(cur.string(field)?),
        ValueType::Array => Value::Array(read_array(cur, key, 1)?),
    })
}

/// Reads an array header and its elements; `depth` is 1 for a top-level array.
fn read_array(cur: &mut Cursor<'_>, key: &str, depth: usize) -> Result<Array> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            path: cur.path.into(),
            offset: cur.offset(),
            key: key.to_string(),
            max_depth: MAX_ARRAY_DEPTH,
        });
    }
    let elem_type = cur.value_type(Field::ArrayType { key })?;
    let count = cur.count(Field::ArrayCount { key }, elem_type.min_encoded_size())?;
    let field = Field::Elements { key };
    Ok(match elem_type {
        ValueType::U8 => Array::U8(cur.take(count, field)?.to_vec()),
        ValueType::I8 => Array::I8(cur.fixed(count, field, i8::from_le_bytes)?),
        ValueType::U16 => Array::U16(cur.fixed(count, field, u16::from_le_bytes)?),
        ValueType::I16 => Array::I16(cur.fixed(count, field, i16::from_le_bytes)?),
        ValueType::U32 => Array::U32(cur.fixed(count, field, u32::from_le_bytes)?),
        ValueType::I32 => Array::I32(cur.fixed(count, field, i32::from_le_bytes)?),
        ValueType::F32 => Array::F32(cur.fixed(count, field, f32::from_le_bytes)?),
        ValueType::U64 => Array::U64(cur.fixed(count, field, u64::from_le_bytes)?),
        ValueType::I64 => Array::I64(cur.fixed(count, field, i64::from_le_bytes)?),
        ValueType::F64 => Array::F64(cur.fixed(count, field, f64::from_le_bytes)?),
        ValueType::Bool => {
            let offset = cur.offset();
            Array::Bool(cur.bools(count, offset, field)?)
        }
        ValueType::String => {
            // Every string is at least its 8-byte length, so the text is at most what is left.
            let max_text = cur.remaining().saturating_sub(8 * count);
            let mut items = StringArray::with_capacity(
                count.min(MAX_PREALLOCATED_ITEMS),
                max_text.min(MAX_PREALLOCATED_TEXT),
            );
            for index in 0..count as u64 {
                items.push(cur.str(Field::Element { key, index })?);
            }
            Array::String(items)
        }
        ValueType::Array => {
            let mut items = Vec::with_capacity(count.min(MAX_PREALLOCATED_ITEMS));
            for _ in 0..count {
                items.push(read_array(cur, key, depth + 1)?);
            }
            Array::Array(items)
        }
    })
}

fn read_tensor_infos(cur: &mut Cursor<'_>, tensor_count: usize) -> Result<Vec<TensorInfo>> {
    let mut tensors = Vec::with_capacity(tensor_count.min(MAX_PREALLOCATED_ITEMS));
    let mut seen = HashMap::with_capacity(tensor_count.min(MAX_PREALLOCATED_ITEMS));
    for index in 0..tensor_count as u64 {
        let info_offset = cur.offset();
        let name = cur.string(Field::TensorName { index })?;
        if seen.insert(name.clone(), ()).is_some() {
            let path = cur.path.into();
            return Err(GgufError::DuplicateTensor {
                path,
                offset: info_offset,
                tensor: name,
            });
        }
        let tensor = name.as_str();
        let dims_offset = cur.offset();
        let n_dims = cur.u32(Field::TensorDimCount { tensor })?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            let path = cur.path.into();
            return Err(GgufError::BadDimCount {
                path,
                offset: dims_offset,
                tensor: name,
                n_dims,
            });
        }
        let mut dims = [1u64; MAX_DIMS];
        for (dim, slot) in dims.iter_mut().enumerate().take(n_dims as usize) {
            *slot = cur.u64(Field::TensorDim { tensor, dim })?;
        }
        let shape = Shape::from_ne(dims, n_dims as usize);
        let type_offset = cur.offset();
        let type_id = cur.u32(Field::TensorType { tensor })?;
        let Some(dtype) = GgmlType::from_id(type_id) else {
            let path = cur.path.into();
            return Err(GgufError::UnknownTensorType {
                path,
                offset: type_offset,
                tensor: name,
                type_id,
            });
        };
        let offset_in_data = cur.u64(Field::TensorOffset { tensor })?;
        let n_bytes = tensor_n_bytes(dtype, &shape).map_err(|problem| {
            let (path, offset, tensor) = (cur.path.into(), info_offset, name.clone());
            match problem {
                ShapeProblem::Overflow => GgufError::ShapeOverflow {
                    path,
                    offset,
                    tensor,
                    dtype,
                    shape: shape.to_vec(),
                },
                ShapeProblem::RowNotWholeBlocks => GgufError::RowNotWholeBlocks {
                    path,
                    offset,
                    tensor,
                    dtype,
                    row_len: shape[0],
                    block_size: dtype.block_size(),
                },
            }
        })?;
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            offset_in_data,
            n_bytes,
            file_offset: 0,
        });
    }
    Ok(tensors)
}

fn alignment_of(path: &Path, metadata: &Metadata) -> Result<u64> {
    let Some(value) = metadata.get(ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT.into());
    };
    match value.as_integer() {
        Some(a) if a > 0 && a <= i128::from(u32::MAX) && (a as u64).is_power_of_two() => {
            Ok(a as u64)
        }
        Some(a) => Err(GgufError::BadAlignment {
            path: path.into(),
            found: format!("{} {a}", value.type_description()),
        }),
        None => Err(GgufError::BadAlignment {
            path: path.into(),
            found: format!("a value of type {}", value.type_description()),
        }),
    }
}

/// Resolves each tensor's absolute offset, checking alignment and that the data fits the file.
fn place_tensors(
    path: &Path,
    tensors: &mut [TensorInfo],
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<()> {
    for tensor in tensors {
        if !tensor.offset_in_data.is_multiple_of(alignment) {
            return Err(GgufError::TensorMisaligned {
                path: path.into(),
                tensor: tensor.name.clone(),
                offset_in_data: tensor.offset_in_data,
                alignment,
            });
        }
        let start = data_offset.saturating_add(tensor.offset_in_data);
        let end = start.saturating_add(tensor.n_bytes);
        if end > file_len || end == u64::MAX {
            return Err(GgufError::TensorOutOfBounds {
                path: path.into(),
                tensor: tensor.name.clone(),
                start,
                end,
                file_len,
            });
        }
        tensor.file_offset = start;
    }
    Ok(())
}

/// Sorted by start, every non-empty tensor must begin at or after the furthest end seen so far.
fn check_no_overlap(path: &Path, tensors: &[TensorInfo]) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_unstable_by_key(|t| (t.file_offset, t.n_bytes));
    let mut furthest: Option<&TensorInfo> = None;
    for tensor in order {
        if let Some(prev) = furthest
            && tensor.file_offset < prev.file_range().end
        {
            return Err(GgufError::TensorsOverlap {
                path: path.into(),
                first: prev.name.clone(),
                first_range: (prev.file_range().start, prev.file_range().end),
                second: tensor.name.clone(),
                second_range: (tensor.file_range().start, tensor.file_range().end),
            });
        }
        if furthest.is_none_or(|prev| tensor.file_range().end > prev.file_range().end) {
            furthest = Some(tensor);
        }
    }
    Ok(())
}
