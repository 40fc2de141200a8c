//! The GGUF reader on arbitrary bytes: `GgufFile::from_bytes` is the parser `GgufFile::open`
//! runs over the mapped file. A file it accepts must keep its promises (every tensor's bytes
//! inside the file, every accessor infallible), form a one-file `GgufModel`, and — when the
//! writer accepts its metadata and tensors — read back from what the writer makes of it.
#![no_main]

use gguf::{GgufFile, GgufModel, GgufVersion, GgufWriter, Value};
use libfuzzer_sys::fuzz_target;

/// Above this the round trip would write a file of the alignment's size (legitimately).
const MAX_ROUND_TRIP_ALIGNMENT: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    assert!(matches!(file.version(), 2 | 3));
    assert!(file.alignment().is_power_of_two());
    let meta = file.metadata();
    for (key, value) in meta.iter() {
        let _ = (value.type_description(), value.as_integer(), value.as_str());
        if let Some(array) = value.as_array() {
            let _ = (array.len(), array.depth(), array.type_description());
            for i in 0..array.len().min(16) {
                let _ = array.integer_at(i);
            }
        }
        // The typed accessors the loaders use, on every key.
        let _ = (
            meta.get_u32(key),
            meta.get_u64(key),
            meta.get_i64(key),
            meta.get_f32(key),
        );
        let _ = (
            meta.get_bool(key),
            meta.get_str(key),
            meta.get_str_array(key),
        );
        let _ = (
            meta.get_f32_array(key),
            meta.get_u32_array(key),
            meta.get_i32_array(key),
        );
    }
    let _ = meta.arch().map(|_| meta.arch_u32_opt("block_count"));
    let (file_len, version) = (file.file_len(), file.version());
    for info in file.tensors() {
        let bytes = file
            .data(info)
            .expect("a validated tensor lies inside the file");
        assert_eq!(bytes.len() as u64, info.n_bytes);
        assert!(info.file_range().end <= file_len);
        assert_eq!(info.file_offset, file.data_offset() + info.offset_in_data);
        assert!(file.tensor(&info.name).is_some() && file.location(&info.name).is_some());
        let _ = (info.rows(), info.row_len(), info.row_bytes());
        for i in 0..info.shape.last().copied().unwrap_or(0).min(4) {
            let range = info
                .outer_slice_range(i)
                .expect("an index below the outer dimension");
            assert!(range.end <= info.n_bytes);
        }
    }
    let fingerprint = file.fingerprint();
    let round_trip = round_trip(&file);
    let (encoded_meta, index) = (encode_metadata(&file), tensor_index(&file));

    // A model of this one file (what `GgufModel::open` makes of a file without splits).
    if let Ok(model) = GgufModel::from_splits(vec![file]) {
        assert_eq!(model.fingerprint(), fingerprint);
        assert_eq!(model.tensors().count(), model.tensor_count());
        for t in model.tensors() {
            assert_eq!(t.data().len() as u64, t.info.n_bytes);
        }
    }

    // What the writer made of it reads back as the same file.
    if let Some((bytes, tensors)) = round_trip {
        let back = GgufFile::from_bytes("round-trip.gguf", bytes)
            .unwrap_or_else(|e| panic!("the writer's output does not read back: {e}"));
        assert_eq!(back.version(), version);
        assert!(
            encode_metadata(&back) == encoded_meta,
            "the round trip changed the metadata"
        );
        assert_eq!(
            tensor_index(&back),
            index,
            "the round trip changed the tensor index"
        );
        for (name, data) in tensors {
            assert_eq!(back.tensor_data(&name), Some(&data[..]), "tensor {name}");
        }
    }
});

/// Keys, types and encoded values in file order (bytes: a NaN equals itself).
fn encode_metadata(file: &GgufFile) -> Vec<(String, Vec<u8>)> {
    let meta = file.metadata().iter();
    meta.map(|(key, value)| {
        let mut bytes = value.value_type().id().to_le_bytes().to_vec();
        value.encode(&mut bytes);
        (key.to_string(), bytes)
    })
    .collect()
}

/// Names, types and shapes in file order.
fn tensor_index(file: &GgufFile) -> Vec<(String, gguf::GgmlType, Vec<u64>)> {
    let infos = file.tensors().iter();
    infos
        .map(|t| (t.name.clone(), t.dtype, t.shape.dims().to_vec()))
        .collect()
}

/// The file written again by `GgufWriter` (same version, metadata and tensors), unless the writer
/// refuses something the reader accepted; with each tensor's bytes.
fn round_trip(file: &GgufFile) -> Option<(Vec<u8>, Vec<(String, Vec<u8>)>)> {
    if file.alignment() > MAX_ROUND_TRIP_ALIGNMENT
        || matches!(file.metadata().get(gguf::ALIGNMENT_KEY), Some(v) if !matches!(v, Value::U32(_)))
    {
        return None;
    }
    let mut writer = GgufWriter::with_metadata(file.metadata().clone()).ok()?;
    writer.set_version(if file.version() == 2 {
        GgufVersion::V2
    } else {
        GgufVersion::V3
    });
    let mut tensors = Vec::new();
    for info in file.tensors() {
        let data = file.data(info)?.to_vec();
        writer
            .add_tensor(
                info.name.clone(),
                info.dtype,
                info.shape.dims(),
                data.clone(),
            )
            .ok()?;
        tensors.push((info.name.clone(), data));
    }
    let mut out = Vec::new();
    writer.write_to(&mut out).ok()?;
    Some((out, tensors))
}
