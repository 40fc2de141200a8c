//! The low-level parser shared by the reader: a bounds-checked little-endian [`Cursor`] over the
//! file bytes, and [`Field`], which names what is being read so errors can say so. Counts and
//! lengths are checked against the bytes left before anything is taken or allocated.

use std::fmt;
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::value::ValueType;

/// What was being read, for error messages. Cheap to pass around; formatted only on error.
#[derive(Clone, Copy)]
pub(crate) enum Field<'a> {
    Magic,
    Version,
    TensorCount,
    KvCount,
    Key { index: u64 },
    ValueType { key: &'a str },
    Value { key: &'a str },
    ArrayType { key: &'a str },
    ArrayCount { key: &'a str },
    Elements { key: &'a str },
    Element { key: &'a str, index: u64 },
    TensorName { index: u64 },
    TensorDimCount { tensor: &'a str },
    TensorDim { tensor: &'a str, dim: usize },
    TensorType { tensor: &'a str },
    TensorOffset { tensor: &'a str },
}

impl fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::Magic => write!(f, "the magic"),
            Field::Version => write!(f, "the version"),
            Field::TensorCount => write!(f, "the tensor count"),
            Field::KvCount => write!(f, "the metadata entry count"),
            Field::Key { index } => write!(f, "the key of metadata entry {index}"),
            Field::ValueType { key } => write!(f, "the value type of `{key}`"),
            Field::Value { key } => write!(f, "the value of `{key}`"),
            Field::ArrayType { key } => write!(f, "the array element type of `{key}`"),
            Field::ArrayCount { key } => write!(f, "the array length of `{key}`"),
            Field::Elements { key } => write!(f, "the array elements of `{key}`"),
            Field::Element { key, index } => write!(f, "element {index} of `{key}`"),
            Field::TensorName { index } => write!(f, "the name of tensor {index}"),
            Field::TensorDimCount { tensor } => {
                write!(f, "the dimension count of tensor `{tensor}`")
            }
            Field::TensorDim { tensor, dim } => write!(f, "dimension {dim} of tensor `{tensor}`"),
            Field::TensorType { tensor } => write!(f, "the type of tensor `{tensor}`"),
            Field::TensorOffset { tensor } => write!(f, "the data offset of tensor `{tensor}`"),
        }
    }
}

/// A bounds-checked little-endian reader over the file bytes.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The file, named in every error.
    pub(crate) path: &'a Path,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8], path: &'a Path) -> Self {
        Self {
            bytes,
            pos: 0,
            path,
        }
    }

    pub(crate) fn offset(&self) -> u64 {
        self.pos as u64
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    pub(crate) fn take(&mut self, n: usize, field: Field<'_>) -> Result<&'a [u8]> {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        match rest.get(..n) {
            Some(taken) => {
                self.pos += n;
                Ok(taken)
            }
            None => Err(GgufError::Truncated {
                path: self.path.into(),
                offset: self.offset(),
                field: field.to_string(),
                needed: n as u64,
                available: rest.len() as u64,
            }),
        }
    }

    pub(crate) fn array<const N: usize>(&mut self, field: Field<'_>) -> Result<[u8; N]> {
        let taken = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(taken);
        Ok(out)
    }

    pub(crate) fn u32(&mut self, field: Field<'_>) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, field: Field<'_>) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub(crate) fn value_type(&mut self, field: Field<'_>) -> Result<ValueType> {
        let offset = self.offset();
        let type_id = self.u32(field)?;
        ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.into(),
            offset,
            field: field.to_string(),
            type_id,
        })
    }

    /// Reads a u64 count and checks that `count` entries of at least `min_bytes_each` bytes
    /// could fit in what is left of the file.
    pub(crate) fn count(&mut self, field: Field<'_>, min_bytes_each: usize) -> Result<usize> {
        let offset = self.offset();
        let count = self.u64(field)?;
        let remaining = self.remaining() as u64;
        let fits = count
            .checked_mul(min_bytes_each as u64)
            .is_some_and(|b| b <= remaining);
        if !fits {
            return Err(GgufError::CountTooLarge {
                path: self.path.into(),
                offset,
                field: field.to_string(),
                count,
                min_bytes_each: min_bytes_each as u64,
                remaining,
            });
        }
        // `count <= remaining <= usize::MAX`, so the conversion is exact.
        Ok(count as usize)
    }

    pub(crate) fn string(&mut self, field: Field<'_>) -> Result<String> {
        self.str(field).map(str::to_owned)
    }

    /// A GGUF string borrowed from the file bytes.
    pub(crate) fn str(&mut self, field: Field<'_>) -> Result<&'a str> {
        let offset = self.offset();
        let len = self.u64(field)?;
        let remaining = self.remaining() as u64;
        if len > remaining {
            return Err(GgufError::StringTooLong {
                path: self.path.into(),
                offset,
                field: field.to_string(),
                len,
                remaining,
            });
        }
        let raw = self.take(len as usize, field)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s),
            Err(e) => Err(GgufError::InvalidUtf8 {
                path: self.path.into(),
                offset: offset + 8 + e.valid_up_to() as u64,
                field: field.to_string(),
            }),
        }
    }

    /// `count` fixed-size little-endian values; the caller has bounded `count` by
    /// [`Cursor::count`] with `min_bytes_each == N`, so `count * N` cannot overflow.
    pub(crate) fn fixed<T, const N: usize>(
        &mut self,
        count: usize,
        field: Field<'_>,
        from_le: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let raw = self.take(count * N, field)?;
        let (chunks, _) = raw.as_chunks::<N>();
        Ok(chunks.iter().map(|&chunk| from_le(chunk)).collect())
    }

    /// `count` bools, each byte 0 or 1.
    pub(crate) fn bools(
        &mut self,
        count: usize,
        offset: u64,
        field: Field<'_>,
    ) -> Result<Vec<bool>> {
        let raw = self.take(count, field)?;
        if let Some(i) = raw.iter().position(|&b| b > 1) {
            return Err(GgufError::InvalidBool {
                path: self.path.into(),
                offset: offset + i as u64,
                field: field.to_string(),
                byte: raw[i],
            });
        }
        Ok(raw.iter().map(|&b| b == 1).collect())
    }
}
