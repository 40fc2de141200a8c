//! [`GgufModel`]: a model stored in one GGUF file or in a llama.cpp split set
//! (`name-00001-of-00003.gguf`, ...). Opening any split finds and checks the others and merges
//! their tensor indexes into one; metadata comes from the first split, where llama.cpp's
//! gguf-split puts it. Also writes split sets the way gguf-split does (for tools and tests).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::fingerprint::{Fingerprint, PARENT_FINGERPRINT_KEY, fingerprint_files};
use crate::metadata::{ARCHITECTURE_KEY, Metadata};
use crate::reader::{GgufFile, TensorLocation};
use crate::tensor::TensorInfo;
use crate::writer::GgufWriter;

/// 0-based index of this file in its split set (u16 in llama.cpp).
pub const SPLIT_NO_KEY: &str = "split.no";
/// Number of files in the split set (u16 in llama.cpp).
pub const SPLIT_COUNT_KEY: &str = "split.count";
/// Tensors in the whole split set (i32 in llama.cpp).
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// One tensor of a model: which split holds it, and its index entry there.
#[derive(Clone, Copy, Debug)]
pub struct ModelTensor<'a> {
    /// 0-based split index.
    pub split: usize,
    pub file: &'a GgufFile,
    pub info: &'a TensorInfo,
}

impl<'a> ModelTensor<'a> {
    /// The tensor's bytes, borrowed from its split's map.
    pub fn data(&self) -> &'a [u8] {
        // The info came from this file's validated index, so the range is inside the map.
        self.file.data(self.info).unwrap_or_default()
    }

    /// The file holding the tensor.
    pub fn path(&self) -> &'a Path {
        self.file.path()
    }

    /// File path and absolute byte range, for `pread`-based readers.
    pub fn location(&self) -> TensorLocation {
        TensorLocation {
            path: self.file.shared_path(),
            offset: self.info.file_offset,
            n_bytes: self.info.n_bytes,
        }
    }
}

/// A model of one or more GGUF files with one merged tensor index.
#[derive(Debug)]
pub struct GgufModel {
    splits: Vec<GgufFile>,
    /// Tensor name → (split, index in that split's tensor list).
    index: HashMap<String, (usize, usize)>,
    /// The identity of the model this file is a part of (`moeshard shard` output).
    parent: Option<Fingerprint>,
}

impl GgufModel {
    /// Opens a single-file model, or the whole split set when `path` is any one of its files.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let given = GgufFile::open(path)?;
        let count = match given.metadata().get_u64(SPLIT_COUNT_KEY)? {
            None | Some(1) => return Self::from_splits(vec![given]),
            Some(count) => count,
        };
        let name = SplitName::parse(path).ok_or_else(|| GgufError::BadSplitName {
            path: path.into(),
            count,
        })?;
        if name.count != count {
            return Err(GgufError::SplitCountMismatch {
                path: path.into(),
                expected: name.count,
                found: count,
            });
        }
        let mut given = Some(given);
        let mut files = Vec::new();
        for index in 0..count {
            if index + 1 == name.number {
                files.extend(given.take());
                continue;
            }
            let split_path = name.path_for(index);
            match GgufFile::open(&split_path) {
                Ok(file) => files.push(file),
                Err(GgufError::Io { path, error }) if error.kind() == io::ErrorKind::NotFound => {
                    return Err(GgufError::MissingSplit {
                        path,
                        split_no: u32::try_from(index + 1).unwrap_or(u32::MAX),
                        count: u32::try_from(count).unwrap_or(u32::MAX),
                        error,
                    });
                }
                Err(other) => return Err(other),
            }
        }
        Self::from_splits(files)
    }

    /// A model from already-opened files in split order, checking that they form one set:
    /// `split.count` and consecutive `split.no` in every file (when more than one), the same
    /// architecture wherever stated, no tensor in two files, and `split.tensors.count`.
    pub fn from_splits(splits: Vec<GgufFile>) -> Result<Self> {
        let Some(first) = splits.first() else {
            return Err(GgufError::InvalidSplitSet {
                reason: "no files".into(),
            });
        };
        let arch = first.metadata().get_str(ARCHITECTURE_KEY)?;
        let n_splits = splits.len() as u64;
        for (index, file) in splits.iter().enumerate() {
            check_split_keys(file, index as u64, n_splits)?;
            let file_arch = file.metadata().get_str(ARCHITECTURE_KEY)?;
            if let (Some(expected), Some(found)) = (arch, file_arch)
                && expected != found
            {
                return Err(GgufError::SplitArchMismatch {
                    path: file.path().into(),
                    expected: expected.into(),
                    found: found.into(),
                });
            }
        }

        let total: usize = splits.iter().map(|f| f.tensors().len()).sum();
        let mut index: HashMap<String, (usize, usize)> = HashMap::with_capacity(total);
        for (split, file) in splits.iter().enumerate() {
            for (i, tensor) in file.tensors().iter().enumerate() {
                if let Some(&(earlier, _)) = index.get(&tensor.name) {
                    return Err(GgufError::DuplicateTensorAcrossSplits {
                        tensor: tensor.name.clone(),
                        first: splits[earlier].path().into(),
                        second: file.path().into(),
                    });
                }
                index.insert(tensor.name.clone(), (split, i));
            }
        }
        if let Some(expected) = first.metadata().get_u64(SPLIT_TENSORS_COUNT_KEY)?
            && expected != total as u64
        {
            return Err(GgufError::SplitTensorCountMismatch {
                path: first.path().into(),
                expected,
                found: total as u64,
            });
        }
        let parent = match first.metadata().get_str(PARENT_FINGERPRINT_KEY)? {
            None => None,
            Some(hex) => {
                Some(
                    Fingerprint::from_hex(hex).ok_or_else(|| GgufError::InvalidValue {
                        key: PARENT_FINGERPRINT_KEY.into(),
                        reason: format!("{hex:?} is not 64 hex digits"),
                    })?,
                )
            }
        };
        Ok(Self {
            splits,
            index,
            parent,
        })
    }

    /// The model's metadata: the first split's.
    pub fn metadata(&self) -> &Metadata {
        self.splits[0].metadata()
    }

    /// The files in split order (one for a single-file model).
    pub fn splits(&self) -> &[GgufFile] {
        &self.splits
    }

    pub fn tensor(&self, name: &str) -> Option<ModelTensor<'_>> {
        let &(split, i) = self.index.get(name)?;
        let file = &self.splits[split];
        Some(ModelTensor {
            split,
            file,
            info: &file.tensors()[i],
        })
    }

    /// Every tensor, in split order then file order.
    pub fn tensors(&self) -> impl Iterator<Item = ModelTensor<'_>> {
        self.splits.iter().enumerate().flat_map(|(split, file)| {
            file.tensors()
                .iter()
                .map(move |info| ModelTensor { split, file, info })
        })
    }

    pub fn tensor_count(&self) -> usize {
        self.index.len()
    }

    /// Where tensor `name` lives on disk.
    pub fn location(&self, name: &str) -> Option<TensorLocation> {
        self.tensor(name).map(|t| t.location())
    }

    /// The model identity peers compare: SHA-256 over all splits' metadata and tensor indexes,
    /// or, for a shard file, the parent model's (the part stands for the whole it came from).
    pub fn fingerprint(&self) -> Fingerprint {
        self.parent.unwrap_or_else(|| self.own_fingerprint())
    }

    /// The hash of these files themselves, whatever they are a part of.
    pub fn own_fingerprint(&self) -> Fingerprint {
        fingerprint_files(self.splits.iter().map(|f| (f.metadata(), f.tensors())))
    }

    /// Whether these files are a part of another model (a `moeshard shard` file).
    pub fn is_shard(&self) -> bool {
        self.parent.is_some()
    }
}

fn check_split_keys(file: &GgufFile, index: u64, n_splits: u64) -> Result<()> {
    let metadata = file.metadata();
    let path = || file.path().to_path_buf();
    let count = metadata.get_u64(SPLIT_COUNT_KEY)?;
    let number = metadata.get_u64(SPLIT_NO_KEY)?;
    if n_splits > 1 {
        let count = count.ok_or_else(|| GgufError::MissingSplitKey {
            path: path(),
            key: SPLIT_COUNT_KEY,
        })?;
        if number.is_none() {
            return Err(GgufError::MissingSplitKey {
                path: path(),
                key: SPLIT_NO_KEY,
            });
        }
        if count != n_splits {
            return Err(GgufError::SplitCountMismatch {
                path: path(),
                expected: n_splits,
                found: count,
            });
        }
    } else if let Some(count) = count.filter(|&c| c != 1) {
        return Err(GgufError::SplitCountMismatch {
            path: path(),
            expected: 1,
            found: count,
        });
    }
    match number {
        Some(found) if found != index => Err(GgufError::SplitNumberMismatch {
            path: path(),
            expected: index,
            found,
        }),
        _ => Ok(()),
    }
}

/// A parsed `<prefix>-NNNNN-of-MMMMM.gguf` file name; digit widths are kept so sibling names
/// are rebuilt exactly as found.
struct SplitName {
    dir: PathBuf,
    prefix: String,
    /// 1-based, as in the file name.
    number: u64,
    number_width: usize,
    count: u64,
    count_width: usize,
}

impl SplitName {
    fn parse(path: &Path) -> Option<Self> {
        let file_name = path.file_name()?.to_str()?;
        let stem = file_name.strip_suffix(".gguf")?;
        let (rest, count_digits) = stem.rsplit_once("-of-")?;
        let (prefix, number_digits) = rest.rsplit_once('-')?;
        let digits = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().ok())?
        };
        let number = digits(number_digits).filter(|&n| n >= 1)?;
        let count = digits(count_digits).filter(|&c| c >= number)?;
        Some(Self {
            dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            prefix: prefix.to_string(),
            number,
            number_width: number_digits.len(),
            count,
            count_width: count_digits.len(),
        })
    }

    /// The path of the split with 0-based `index`.
    fn path_for(&self, index: u64) -> PathBuf {
        self.dir.join(format!(
            "{}-{:0nw$}-of-{:0cw$}.gguf",
            self.prefix,
            index + 1,
            self.count,
            nw = self.number_width,
            cw = self.count_width
        ))
    }
}

/// `base-00001-of-00003.gguf` for `index` 0 of 3 (llama.cpp's naming; `index` is 0-based).
pub fn split_file_path(base: impl AsRef<Path>, index: u16, count: u16) -> PathBuf {
    let mut name = OsString::from(base.as_ref().as_os_str());
    name.push(format!("-{:05}-of-{:05}.gguf", u32::from(index) + 1, count));
    PathBuf::from(name)
}

/// Writes one file per writer as a split set named after `base` (see [`split_file_path`]),
/// adding `split.no` (u16), `split.count` (u16) and `split.tensors.count` (i32) to each, as
/// llama.cpp's gguf-split does. Put the model metadata in the first writer only. Returns the
/// paths written, in split order.
pub fn write_split_model(
    base: impl AsRef<Path>,
    mut splits: Vec<GgufWriter<'_>>,
) -> Result<Vec<PathBuf>> {
    let count = u16::try_from(splits.len())
        .ok()
        .filter(|&c| c > 0)
        .ok_or_else(|| GgufError::InvalidSplitSet {
            reason: format!("{} splits (must be 1..=65535)", splits.len()),
        })?;
    let total: usize = splits.iter().map(GgufWriter::tensor_count).sum();
    let total = i32::try_from(total).map_err(|_| GgufError::InvalidSplitSet {
        reason: format!("{total} tensors do not fit split.tensors.count (i32)"),
    })?;
    let mut paths = Vec::with_capacity(splits.len());
    for (index, writer) in (0u16..).zip(splits.iter_mut()) {
        writer.set_metadata(SPLIT_NO_KEY, index)?;
        writer.set_metadata(SPLIT_COUNT_KEY, count)?;
        writer.set_metadata(SPLIT_TENSORS_COUNT_KEY, total)?;
        let path = split_file_path(base.as_ref(), index, count);
        writer.write_to_path(&path)?;
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_with(key: Option<&str>) -> Result<GgufModel> {
        let mut w = GgufWriter::new();
        w.add_metadata(ARCHITECTURE_KEY, "llama")?;
        if let Some(hex) = key {
            w.add_metadata(PARENT_FINGERPRINT_KEY, hex)?;
        }
        w.add_tensor("t", crate::GgmlType::F32, &[2], vec![0u8; 8])?;
        let mut bytes = Vec::new();
        w.write_to(&mut bytes)?;
        assert_eq!(
            w.file_len(),
            bytes.len() as u64,
            "file_len is the written size"
        );
        GgufModel::from_splits(vec![GgufFile::from_bytes("m.gguf", bytes)?])
    }

    #[test]
    fn a_shard_file_presents_its_parents_fingerprint() {
        let full = model_with(None).unwrap();
        assert!(!full.is_shard());
        assert_eq!(full.fingerprint(), full.own_fingerprint());
        let parent = Fingerprint([0xab; 32]);
        let shard = model_with(Some(&parent.to_string())).unwrap();
        assert!(shard.is_shard());
        assert_eq!(shard.fingerprint(), parent);
        assert_ne!(shard.own_fingerprint(), parent);
        let err = model_with(Some("not hex")).unwrap_err().to_string();
        assert!(err.contains(PARENT_FINGERPRINT_KEY), "{err}");
        assert_eq!(Fingerprint::from_hex(&parent.to_string()), Some(parent));
        assert_eq!(Fingerprint::from_hex(&"g".repeat(64)), None);
    }

    #[test]
    fn split_names_parse_and_rebuild() {
        let name =
            SplitName::parse(Path::new("/m/Qwen3-30B-A3B-Q4_K_M-00002-of-00003.gguf")).unwrap();
        assert_eq!((name.number, name.count), (2, 3));
        assert_eq!(
            name.path_for(0),
            Path::new("/m/Qwen3-30B-A3B-Q4_K_M-00001-of-00003.gguf")
        );
        assert_eq!(
            split_file_path("/m/Qwen3-30B-A3B-Q4_K_M", 2, 3),
            Path::new("/m/Qwen3-30B-A3B-Q4_K_M-00003-of-00003.gguf")
        );
        for bad in [
            "m.gguf",
            "m-00001-of-.gguf",
            "m-00004-of-00003.gguf",
            "m-0-of-3.bin",
            "m-00000-of-00003.gguf",
        ] {
            assert!(SplitName::parse(Path::new(bad)).is_none(), "{bad}");
        }
    }
}
