//! Property tests: random metadata and tensors survive writer → reader → writer byte for byte,
//! and random corruption of a valid file never panics the reader.

use std::collections::BTreeMap;

use gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::sample::Index;

use crate::common::{parse, sample_bytes};

fn leaf_array() -> impl Strategy<Value = Array> {
    prop_oneof![
        vec(any::<u8>(), 0..8).prop_map(Array::U8),
        vec(any::<i8>(), 0..8).prop_map(Array::I8),
        vec(any::<u16>(), 0..8).prop_map(Array::U16),
        vec(any::<i16>(), 0..8).prop_map(Array::I16),
        vec(any::<u32>(), 0..8).prop_map(Array::U32),
        vec(any::<i32>(), 0..8).prop_map(Array::I32),
        vec(any::<f32>(), 0..8).prop_map(Array::F32),
        vec(any::<bool>(), 0..8).prop_map(Array::Bool),
        vec(".{0,12}", 0..8).prop_map(Array::from),
        vec(any::<u64>(), 0..8).prop_map(Array::U64),
        vec(any::<i64>(), 0..8).prop_map(Array::I64),
        vec(any::<f64>(), 0..8).prop_map(Array::F64),
    ]
}

fn array() -> impl Strategy<Value = Array> {
    leaf_array().prop_recursive(3, 32, 4, |inner| vec(inner, 0..4).prop_map(Array::Array))
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<f32>().prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        ".{0,24}".prop_map(Value::String),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f64>().prop_map(Value::F64),
        array().prop_map(Value::Array),
    ]
}

/// (type, shape, data) with the data length matching the shape.
fn tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, Vec<u8>)> {
    let dtypes = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::I8,
        GgmlType::Q8_0,
        GgmlType::Q4K,
    ];
    (
        prop::sample::select(dtypes.to_vec()),
        1u64..4,
        vec(1u64..4, 0..4),
    )
        .prop_flat_map(|(dtype, blocks, outer)| {
            let mut shape = vec![blocks * dtype.block_size() as u64];
            shape.extend(outer);
            let rows: u64 = shape[1..].iter().product();
            let len = (blocks * dtype.type_size() as u64 * rows) as usize;
            (Just(dtype), Just(shape), vec(any::<u8>(), len))
        })
}

fn write(writer: &GgufWriter<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    writer.write_to(&mut out).unwrap();
    out
}

fn rewrite(file: &GgufFile) -> Vec<u8> {
    let mut writer = GgufWriter::with_metadata(file.metadata().clone()).unwrap();
    for info in file.tensors() {
        writer
            .add_tensor(
                &info.name,
                info.dtype,
                &info.shape,
                file.data(info).unwrap(),
            )
            .unwrap();
    }
    write(&writer)
}

proptest! {
    #[test]
    fn random_files_round_trip(
        metadata in btree_map("[a-z_.]{1,16}", value(), 0..12),
        tensors in vec(tensor(), 0..6),
        alignment_log2 in prop::option::of(0u32..10),
    ) {
        let metadata: BTreeMap<String, Value> = metadata;
        let mut writer = GgufWriter::new();
        if let Some(log2) = alignment_log2 {
            writer.set_alignment(1 << log2).unwrap();
        }
        for (key, value) in &metadata {
            writer.add_metadata(key.clone(), value.clone()).unwrap();
        }
        for (i, (dtype, shape, data)) in tensors.iter().enumerate() {
            writer.add_tensor(format!("t{i}"), *dtype, shape, data.as_slice()).unwrap();
        }
        let bytes = write(&writer);
        let file = parse(bytes.clone()).unwrap();

        let keys: Vec<&str> = file.metadata().keys().collect();
        let expected: Vec<&str> = writer.metadata().keys().collect();
        prop_assert_eq!(keys, expected);
        prop_assert_eq!(file.tensors().len(), tensors.len());
        for (i, (dtype, shape, data)) in tensors.iter().enumerate() {
            let info = file.tensor(&format!("t{i}")).unwrap();
            prop_assert_eq!(info.dtype, *dtype);
            prop_assert_eq!(info.shape.dims(), shape.as_slice());
            prop_assert_eq!(file.data(info).unwrap(), data.as_slice());
        }
        // Byte-exact re-encoding covers every value, NaN payloads included.
        prop_assert_eq!(rewrite(&file), bytes.clone());
        prop_assert_eq!(parse(bytes).unwrap().fingerprint(), file.fingerprint());
    }

    #[test]
    fn random_byte_mutations_never_panic(
        edits in vec((any::<Index>(), any::<u8>()), 1..8),
        truncate in prop::option::of(any::<Index>()),
    ) {
        let mut bytes = sample_bytes();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if let Some(at) = truncate {
            bytes.truncate(at.index(bytes.len()));
        }
        let _ = parse(bytes);
    }

    #[test]
    fn random_wide_fields_never_panic(
        edits in vec((any::<Index>(), prop_oneof![any::<u64>(), 0u64..64, Just(u64::MAX)]), 1..4),
    ) {
        // Overwrite 8-byte windows, hitting counts, lengths, dims and offsets with huge values.
        let mut bytes = sample_bytes();
        for (at, value) in edits {
            let i = at.index(bytes.len() - 8);
            bytes[i..i + 8].copy_from_slice(&value.to_le_bytes());
        }
        let _ = parse(bytes);
    }

    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(body in vec(any::<u8>(), 0..256)) {
        let mut bytes = b"GGUF\x03\0\0\0".to_vec();
        bytes.extend(body);
        let _ = parse(bytes);
    }
}
