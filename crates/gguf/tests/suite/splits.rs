//! Split models: a 3-way split set opened from any of its files, and every way a set can be
//! inconsistent.

use std::path::{Path, PathBuf};

use gguf::{
    GgmlType, GgufError, GgufFile, GgufModel, GgufWriter, split_file_path, write_split_model,
};

use crate::common::pattern;

/// Model metadata in the first split, two tensors per split, as gguf-split lays them out.
fn three_splits() -> Vec<GgufWriter<'static>> {
    let mut splits: Vec<GgufWriter<'static>> = (0..3).map(|_| GgufWriter::new()).collect();
    splits[0]
        .add_metadata("general.architecture", "toy")
        .unwrap();
    splits[0].add_metadata("toy.block_count", 3u32).unwrap();
    for (i, writer) in splits.iter_mut().enumerate() {
        for kind in ["attn", "ffn"] {
            let seed = (i * 2 + usize::from(kind == "ffn")) as u8;
            writer
                .add_tensor(
                    format!("blk.{i}.{kind}.weight"),
                    GgmlType::F32,
                    &[4, 2],
                    pattern(32, seed),
                )
                .unwrap();
        }
    }
    splits
}

fn write_three(dir: &Path) -> Vec<PathBuf> {
    write_split_model(dir.join("toy"), three_splits()).unwrap()
}

#[test]
fn split_set_opens_from_any_file() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    assert_eq!(paths[1], dir.path().join("toy-00002-of-00003.gguf"));

    let models: Vec<GgufModel> = paths.iter().map(|p| GgufModel::open(p).unwrap()).collect();
    for model in &models {
        assert_eq!(model.splits().len(), 3);
        assert_eq!(model.tensor_count(), 6);
        assert_eq!(model.metadata().arch().unwrap(), "toy");
        assert_eq!(model.metadata().u32("split.count").unwrap(), 3);
        assert_eq!(model.fingerprint(), models[0].fingerprint());
        for (i, path) in paths.iter().enumerate() {
            let tensor = model.tensor(&format!("blk.{i}.ffn.weight")).unwrap();
            assert_eq!(tensor.split, i);
            assert_eq!(tensor.path(), path);
            assert_eq!(tensor.data(), pattern(32, (i * 2 + 1) as u8).as_slice());
            let location = tensor.location();
            assert_eq!(&*location.path, path.as_path());
            let on_disk = std::fs::read(path).unwrap();
            let range = location.offset as usize..(location.offset + location.n_bytes) as usize;
            assert_eq!(&on_disk[range], tensor.data());
        }
        let names: Vec<&str> = model.tensors().map(|t| t.info.name.as_str()).collect();
        assert_eq!(names[0], "blk.0.attn.weight");
        assert_eq!(names[5], "blk.2.ffn.weight");
    }
    // Split keys as llama.cpp writes them.
    let second = GgufFile::open(&paths[1]).unwrap();
    assert!(matches!(
        second.metadata().get("split.no"),
        Some(gguf::Value::U16(1))
    ));
    assert!(matches!(
        second.metadata().get("split.tensors.count"),
        Some(gguf::Value::I32(6))
    ));
}

#[test]
fn single_file_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("one.gguf");
    crate::common::sample_writer().write_to_path(&path).unwrap();
    let model = GgufModel::open(&path).unwrap();
    assert_eq!(model.splits().len(), 1);
    assert_eq!(model.tensor_count(), 3);
    assert_eq!(
        model.fingerprint(),
        GgufFile::open(&path).unwrap().fingerprint()
    );
    assert_eq!(
        model.location("tensor.b").unwrap().path.as_ref(),
        path.as_path()
    );
}

#[test]
fn missing_split_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    std::fs::remove_file(&paths[2]).unwrap();
    let err = GgufModel::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::MissingSplit { path, split_no: 3, count: 3, .. } if path == &paths[2]),
        "{err}"
    );
    assert!(err.to_string().contains("toy-00003-of-00003.gguf"), "{err}");
}

/// Rewrites split `index` (0-based) of the set with `edit` applied to its writer.
fn rewrite_split(paths: &[PathBuf], index: usize, edit: impl FnOnce(&mut GgufWriter<'static>)) {
    let mut splits = three_splits();
    let mut writer = splits.swap_remove(index);
    writer.set_metadata("split.no", index as u16).unwrap();
    writer.set_metadata("split.count", 3u16).unwrap();
    writer.set_metadata("split.tensors.count", 6i32).unwrap();
    edit(&mut writer);
    writer.write_to_path(&paths[index]).unwrap();
}

#[test]
fn mismatched_split_count() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    rewrite_split(&paths, 1, |w| drop(w.set_metadata("split.count", 4u16)));
    let err = GgufModel::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::SplitCountMismatch { path, expected: 3, found: 4 } if path == &paths[1]),
        "{err}"
    );
    // Opened from the odd file itself, its name disagrees with its own split.count.
    let err = GgufModel::open(&paths[1]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::SplitCountMismatch {
                expected: 3,
                found: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn split_numbers_must_be_consecutive() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    rewrite_split(&paths, 2, |w| drop(w.set_metadata("split.no", 1u16)));
    let err = GgufModel::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::SplitNumberMismatch { path, expected: 2, found: 1 } if path == &paths[2]),
        "{err}"
    );
}

#[test]
fn split_lacking_split_keys() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    let mut bare = three_splits().swap_remove(1);
    bare.add_metadata("split.count", 3u16).unwrap();
    bare.write_to_path(&paths[1]).unwrap();
    let err = GgufModel::open(&paths[0]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::MissingSplitKey {
                key: "split.no",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn architecture_must_agree() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    rewrite_split(&paths, 1, |w| {
        drop(w.set_metadata("general.architecture", "other"))
    });
    let err = GgufModel::open(&paths[2]).unwrap_err();
    assert!(
        matches!(&err, GgufError::SplitArchMismatch { expected, found, .. } if expected == "toy" && found == "other"),
        "{err}"
    );
}

#[test]
fn duplicate_tensor_across_splits() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    rewrite_split(&paths, 2, |w| {
        w.add_tensor("blk.0.attn.weight", GgmlType::F32, &[1], vec![0u8; 4])
            .unwrap();
    });
    let err = GgufModel::open(&paths[0]).unwrap_err();
    assert!(
        matches!(&err, GgufError::DuplicateTensorAcrossSplits { tensor, first, second }
            if tensor == "blk.0.attn.weight" && first == &paths[0] && second == &paths[2]),
        "{err}"
    );
}

#[test]
fn tensor_total_must_match() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    rewrite_split(&paths, 0, |w| {
        drop(w.set_metadata("split.tensors.count", 7i32))
    });
    let err = GgufModel::open(&paths[1]).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::SplitTensorCountMismatch {
                expected: 7,
                found: 6,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn split_file_with_an_unparseable_name() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_three(dir.path());
    let renamed = dir.path().join("toy.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let err = GgufModel::open(&renamed).unwrap_err();
    assert!(
        matches!(err, GgufError::BadSplitName { count: 3, .. }),
        "{err}"
    );
    assert_eq!(split_file_path(dir.path().join("toy"), 0, 3), paths[0]);
}
