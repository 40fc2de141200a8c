//! Tensor index entries: [`Shape`] (ggml order, `ne[0]` is the contiguous row), [`TensorInfo`]
//! (type, shape, where the bytes are), and the one size rule both the reader and the writer
//! apply: rows are whole blocks and no product overflows u64.

use std::fmt;
use std::ops::{Deref, Range};

use crate::types::GgmlType;

/// Most dimensions a GGUF tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// A tensor shape of 1 to 4 dimensions in ggml order: `shape[0]` is the row length (contiguous),
/// `shape[1]` the number of rows, and so on. Dereferences to `[u64]`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    ne: [u64; MAX_DIMS],
    n_dims: u8,
}

impl Shape {
    /// `None` unless `dims` has 1..=4 entries.
    pub fn new(dims: &[u64]) -> Option<Self> {
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return None;
        }
        let mut ne = [1; MAX_DIMS];
        ne[..dims.len()].copy_from_slice(dims);
        Some(Self {
            ne,
            n_dims: dims.len() as u8,
        })
    }

    /// From ggml's fixed four `ne` values, the first `n_dims` (1..=4, checked by the caller)
    /// being the real dimensions.
    pub(crate) fn from_ne(ne: [u64; MAX_DIMS], n_dims: usize) -> Self {
        debug_assert!((1..=MAX_DIMS).contains(&n_dims));
        Self {
            ne,
            n_dims: n_dims.clamp(1, MAX_DIMS) as u8,
        }
    }

    pub fn dims(&self) -> &[u64] {
        &self.ne[..usize::from(self.n_dims)]
    }

    /// All four `ne` values, unused dimensions set to 1 (as ggml stores them).
    pub fn ne(&self) -> [u64; MAX_DIMS] {
        self.ne
    }

    /// The element count, or `None` on overflow.
    pub fn checked_n_elements(&self) -> Option<u64> {
        self.dims()
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }
}

impl Deref for Shape {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        self.dims()
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.dims()).finish()
    }
}

impl fmt::Display for Shape {
    /// `[4096, 1024, 64]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Why a (type, shape) pair has no valid byte size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShapeProblem {
    RowNotWholeBlocks,
    Overflow,
}

/// Bytes taken by a tensor of `dtype` and `shape`, checking that rows are whole blocks and that
/// neither the element count nor the byte size overflows u64.
pub(crate) fn tensor_n_bytes(dtype: GgmlType, shape: &Shape) -> Result<u64, ShapeProblem> {
    shape.checked_n_elements().ok_or(ShapeProblem::Overflow)?;
    let row_len = shape[0];
    if !row_len.is_multiple_of(dtype.block_size() as u64) {
        return Err(ShapeProblem::RowNotWholeBlocks);
    }
    let row_bytes = dtype.row_bytes(row_len).ok_or(ShapeProblem::Overflow)?;
    shape[1..]
        .iter()
        .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
        .ok_or(ShapeProblem::Overflow)
}

/// One entry of a file's tensor index. Constructed by the reader after validation, so the sizes
/// are consistent and the bytes lie inside the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: GgmlType,
    pub shape: Shape,
    /// Offset from the start of the file's data section (a multiple of the alignment).
    pub offset_in_data: u64,
    /// Bytes of tensor data (`rows() * dtype.row_bytes(row_len())`).
    pub n_bytes: u64,
    /// Absolute offset of the first byte in the file: what to `pread` from.
    pub file_offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Elements per row (`ne[0]`).
    pub fn row_len(&self) -> u64 {
        self.shape[0]
    }

    /// Number of rows (product of `ne[1..]`).
    pub fn rows(&self) -> u64 {
        self.shape[1..]
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.dtype.row_bytes(self.row_len()).unwrap_or(0)
    }

    /// The absolute byte range of the data in the file.
    pub fn file_range(&self) -> Range<u64> {
        self.file_offset..self.file_offset.saturating_add(self.n_bytes)
    }

    /// The byte range, relative to [`TensorInfo::file_offset`], of slice `index` along the
    /// outermost dimension: expert `index` of a stacked `[.., .., n_expert]` expert tensor.
    /// `None` when `index` is out of range.
    pub fn outer_slice_range(&self, index: u64) -> Option<Range<u64>> {
        let outer = *self.shape.last()?;
        if index >= outer {
            return None;
        }
        let slice_bytes = self.n_bytes / outer;
        Some(index * slice_bytes..(index + 1) * slice_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_rules() {
        assert!(Shape::new(&[]).is_none());
        assert!(Shape::new(&[1, 2, 3, 4, 5]).is_none());
        let shape = Shape::new(&[64, 3, 2]).unwrap();
        assert_eq!(shape.ne(), [64, 3, 2, 1]);
        assert_eq!(format!("{shape}"), "[64, 3, 2]");
        assert_eq!(tensor_n_bytes(GgmlType::Q8_0, &shape), Ok(2 * 34 * 6));
        let ragged = Shape::new(&[33, 2]).unwrap();
        assert_eq!(
            tensor_n_bytes(GgmlType::Q8_0, &ragged),
            Err(ShapeProblem::RowNotWholeBlocks)
        );
        let huge = Shape::new(&[1 << 40, 1 << 30]).unwrap();
        assert_eq!(
            tensor_n_bytes(GgmlType::F32, &huge),
            Err(ShapeProblem::Overflow)
        );
        let huge_bytes = Shape::new(&[1 << 62]).unwrap();
        assert_eq!(
            tensor_n_bytes(GgmlType::F32, &huge_bytes),
            Err(ShapeProblem::Overflow)
        );
    }

    #[test]
    fn outer_slices_tile_the_tensor() {
        let info = TensorInfo {
            name: "blk.0.ffn_up_exps.weight".into(),
            dtype: GgmlType::Q4_0,
            shape: Shape::new(&[64, 8, 4]).unwrap(),
            offset_in_data: 0,
            n_bytes: 2 * 18 * 8 * 4,
            file_offset: 1024,
        };
        assert_eq!(info.outer_slice_range(0), Some(0..288));
        assert_eq!(info.outer_slice_range(3), Some(864..1152));
        assert_eq!(info.outer_slice_range(4), None);
        assert_eq!(info.rows(), 32);
        assert_eq!(info.row_bytes(), 36);
    }
}
