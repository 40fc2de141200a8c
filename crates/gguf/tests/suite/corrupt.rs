//! The corrupt-file suite: one test per way a GGUF file can be bad. Each starts from the valid
//! fixture, breaks one field, and checks the exact error variant and that the message names the
//! file, the offset and the field.

use gguf::{Array, GgufError, GgufFile, MAX_ARRAY_DEPTH, Value};

use crate::common::*;

#[test]
fn fixture_is_valid() {
    let file = parse(sample_bytes()).unwrap();
    assert_eq!(file.tensors().len(), 3);
    assert_eq!(
        file.file_len(),
        file.tensor("tensor.c").unwrap().file_range().end
    );
}

#[test]
fn wrong_magic() {
    let mut bytes = sample_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::BadMagic { found, .. } if found == b"GGML"),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "offset 0", "magic"]);
}

#[test]
fn version_1_and_unknown_versions_are_unsupported() {
    for version in [0, 1, 4, 0x0300_0000] {
        let mut bytes = sample_bytes();
        put_u32(&mut bytes, 4, version);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version: v, .. } if v == version),
            "{err}"
        );
        assert_mentions(&err, &[LABEL, "offset 4", &format!("version {version}")]);
    }
}

#[test]
fn truncated_header() {
    let bytes = sample_bytes()[..12].to_vec();
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(
            err,
            GgufError::Truncated {
                offset: 8,
                needed: 8,
                available: 4,
                ..
            }
        ),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "offset 8", "tensor count"]);
}

#[test]
fn truncated_metadata_value() {
    let bytes = sample_bytes();
    // The last metadata entry: key, type u32, then a 4-byte value cut after two bytes.
    let value_at = after_string(&bytes, "test.block_count") + 4;
    let err = parse(bytes[..value_at + 2].to_vec()).unwrap_err();
    assert!(
        matches!(err, GgufError::Truncated { offset, needed: 4, available: 2, .. } if offset == value_at as u64),
        "{err}"
    );
    assert_mentions(
        &err,
        &[
            LABEL,
            &format!("offset {value_at}"),
            "value of `test.block_count`",
        ],
    );
}

#[test]
fn truncated_tensor_info() {
    let bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.c", 1);
    let err = parse(bytes[..at.offset + 3].to_vec()).unwrap_err();
    assert!(
        matches!(err, GgufError::Truncated { offset, .. } if offset == at.offset as u64),
        "{err}"
    );
    assert_mentions(
        &err,
        &[
            LABEL,
            &format!("offset {}", at.offset),
            "data offset of tensor `tensor.c`",
        ],
    );
}

#[test]
fn string_length_larger_than_the_file() {
    for len in [u64::MAX, 1 << 40, 10_000] {
        let mut bytes = sample_bytes();
        let at = string_start(&bytes, DESCRIPTION);
        put_u64(&mut bytes, at, len);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(err, GgufError::StringTooLong { offset, len: l, .. } if offset == at as u64 && l == len),
            "{err}"
        );
        assert_mentions(
            &err,
            &[
                LABEL,
                &format!("offset {at}"),
                "value of `general.description`",
            ],
        );
    }
}

#[test]
fn array_count_larger_than_the_file() {
    for count in [u64::MAX, u64::MAX / 8 + 1, 1 << 40] {
        let mut bytes = sample_bytes();
        // tokens: key, type (9 = array), element type (8 = string), count.
        let count_at = after_string(&bytes, "tokens") + 4 + 4;
        put_u64(&mut bytes, count_at, count);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(err, GgufError::CountTooLarge { offset, count: c, min_bytes_each: 8, .. }
                if offset == count_at as u64 && c == count),
            "{err}"
        );
        assert_mentions(
            &err,
            &[
                LABEL,
                &format!("offset {count_at}"),
                "array length of `tokens`",
            ],
        );
    }
}

#[test]
fn header_counts_larger_than_the_file() {
    let mut bytes = sample_bytes();
    put_u64(&mut bytes, 8, u64::MAX);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::CountTooLarge { offset: 8, .. }),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "offset 8", "tensor count"]);

    let mut bytes = sample_bytes();
    put_u64(&mut bytes, 16, 1 << 50);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::CountTooLarge { offset: 16, .. }),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "offset 16", "metadata entry count"]);
}

#[test]
fn invalid_utf8_in_a_string_value() {
    let mut bytes = sample_bytes();
    let bad = after_string(&bytes, "bb") - 1;
    bytes[bad] = 0xff;
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::InvalidUtf8 { offset, .. } if offset == bad as u64),
        "{err}"
    );
    assert_mentions(
        &err,
        &[LABEL, &format!("offset {bad}"), "element 1 of `tokens`"],
    );
}

#[test]
fn invalid_utf8_in_a_key() {
    let mut bytes = sample_bytes();
    let bad = string_start(&bytes, "scores") + 8;
    bytes[bad] = 0xc3; // a lead byte followed by ASCII
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::InvalidUtf8 { offset, .. } if offset == bad as u64),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "key of metadata entry 3"]);
}

#[test]
fn unknown_value_type() {
    let mut bytes = sample_bytes();
    let type_at = after_string(&bytes, "test.block_count");
    put_u32(&mut bytes, type_at, 13);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::UnknownValueType { type_id: 13, offset, .. } if offset == type_at as u64),
        "{err}"
    );
    assert_mentions(
        &err,
        &[
            LABEL,
            &format!("offset {type_at}"),
            "value type of `test.block_count`",
        ],
    );
}

#[test]
fn invalid_bool() {
    let mut bytes = sample_bytes();
    let value_at = after_string(&bytes, "test.flag") + 4;
    bytes[value_at] = 2;
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(err, GgufError::InvalidBool { byte: 2, offset, .. } if offset == value_at as u64),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, &format!("offset {value_at}"), "`test.flag`"]);
}

/// `depth` arrays nested inside one another, innermost holding one u8.
fn nested(depth: usize) -> Array {
    (1..depth).fold(Array::U8(vec![7]), |inner, _| Array::Array(vec![inner]))
}

#[test]
fn nesting_too_deep() {
    let ok = Raw::header(3, 0, 1)
        .string("deep")
        .u32(9)
        .value(&Value::Array(nested(MAX_ARRAY_DEPTH)))
        .0
        .clone();
    let file = parse(ok).unwrap();
    assert_eq!(
        file.metadata().array("deep").unwrap().depth(),
        MAX_ARRAY_DEPTH
    );

    let too_deep = Raw::header(3, 0, 1)
        .string("deep")
        .u32(9)
        .value(&Value::Array(nested(MAX_ARRAY_DEPTH + 1)))
        .0
        .clone();
    let err = parse(too_deep).unwrap_err();
    assert!(
        matches!(&err, GgufError::NestingTooDeep { key, max_depth: MAX_ARRAY_DEPTH, .. } if key == "deep"),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "offset", "`deep`"]);

    // The writer refuses what the reader would reject.
    let mut writer = gguf::GgufWriter::new();
    let err = writer
        .add_metadata("deep", nested(MAX_ARRAY_DEPTH + 1))
        .unwrap_err();
    assert!(matches!(err, GgufError::InvalidValue { .. }), "{err}");
}

#[test]
fn duplicate_key() {
    let mut bytes = sample_bytes();
    let second = string_start(&bytes, "test.dup_b");
    let last_char = second + 8 + "test.dup_b".len() - 1;
    bytes[last_char] = b'a';
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::DuplicateKey { key, offset, .. } if key == "test.dup_a" && *offset == second as u64),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, &format!("offset {second}"), "`test.dup_a`"]);
}

#[test]
fn bad_alignment_values() {
    let bytes = sample_bytes();
    let type_at = after_string(&bytes, "general.alignment");
    for (type_id, value, expected) in [
        (4, 0u32, "u32 0"),
        (4, 48, "u32 48"),
        (5, u32::MAX, "i32 -1"),
        (6, 32, "type f32"),
    ] {
        let mut bytes = bytes.clone();
        put_u32(&mut bytes, type_at, type_id);
        put_u32(&mut bytes, type_at + 4, value);
        let err = parse(bytes).unwrap_err();
        assert!(matches!(err, GgufError::BadAlignment { .. }), "{err}");
        assert_mentions(&err, &[LABEL, "general.alignment", expected]);
    }
    // Any integer type holding a power of two is accepted.
    let mut bytes = bytes.clone();
    put_u32(&mut bytes, type_at, 5);
    assert_eq!(parse(bytes).unwrap().alignment(), 32);
}

#[test]
fn tensor_data_past_end_of_file() {
    let bytes = sample_bytes();
    let err = parse(bytes[..bytes.len() - 1].to_vec()).unwrap_err();
    assert!(
        matches!(&err, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "tensor.c"),
        "{err}"
    );
    assert_mentions(
        &err,
        &[LABEL, "`tensor.c`", &format!("{} bytes", bytes.len() - 1)],
    );

    for offset in [1 << 20, u64::MAX - 31] {
        let mut bytes = sample_bytes();
        let at = tensor_info_at(&bytes, "tensor.a", 2);
        put_u64(&mut bytes, at.offset, offset);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(&err, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "tensor.a"),
            "{err}"
        );
    }
}

#[test]
fn overlapping_tensors() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.b", 2);
    put_u64(&mut bytes, at.offset, 32); // inside tensor.a's 64 bytes
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::TensorsOverlap { first, second, .. } if first == "tensor.a" && second == "tensor.b"),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "`tensor.a`", "`tensor.b`", "overlap"]);
}

#[test]
fn misaligned_tensor_offset() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.b", 2);
    put_u64(&mut bytes, at.offset, 68);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::TensorMisaligned { tensor, offset_in_data: 68, alignment: 32, .. } if tensor == "tensor.b"),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "`tensor.b`", "offset 68", "alignment 32"]);
}

#[test]
fn unknown_and_removed_tensor_types() {
    for type_id in [4, 5, 31, 36, 1000, u32::MAX] {
        let mut bytes = sample_bytes();
        let at = tensor_info_at(&bytes, "tensor.a", 2);
        put_u32(&mut bytes, at.dtype, type_id);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(&err, GgufError::UnknownTensorType { tensor, type_id: t, offset, .. }
                if tensor == "tensor.a" && *t == type_id && *offset == at.dtype as u64),
            "{err}"
        );
        assert_mentions(
            &err,
            &[
                LABEL,
                "`tensor.a`",
                &format!("id {type_id}"),
                &format!("offset {}", at.dtype),
            ],
        );
    }
}

#[test]
fn dimension_count_out_of_range() {
    for n_dims in [0, 5, u32::MAX] {
        let mut bytes = sample_bytes();
        let at = tensor_info_at(&bytes, "tensor.b", 2);
        put_u32(&mut bytes, at.n_dims, n_dims);
        let err = parse(bytes).unwrap_err();
        assert!(
            matches!(&err, GgufError::BadDimCount { tensor, n_dims: n, offset, .. }
                if tensor == "tensor.b" && *n == n_dims && *offset == at.n_dims as u64),
            "{err}"
        );
        assert_mentions(
            &err,
            &[
                LABEL,
                "`tensor.b`",
                &format!("{n_dims} dimensions"),
                &format!("offset {}", at.n_dims),
            ],
        );
    }
}

#[test]
fn element_count_overflow() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.a", 2);
    put_u64(&mut bytes, at.dims, 1 << 40);
    put_u64(&mut bytes, at.dims + 8, 1 << 40);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShapeOverflow { tensor, .. } if tensor == "tensor.a"),
        "{err}"
    );
    assert_mentions(
        &err,
        &[
            LABEL,
            "`tensor.a`",
            "overflows",
            &format!("offset {}", at.name),
        ],
    );
}

#[test]
fn byte_size_overflow() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.a", 2);
    // 2^62 f32 elements fit u64, their 2^64 bytes do not.
    put_u64(&mut bytes, at.dims, 1 << 61);
    put_u64(&mut bytes, at.dims + 8, 2);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::ShapeOverflow { tensor, .. } if tensor == "tensor.a"),
        "{err}"
    );
}

#[test]
fn row_not_a_whole_number_of_blocks() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.b", 2);
    put_u64(&mut bytes, at.dims, 33);
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::RowNotWholeBlocks { tensor, row_len: 33, block_size: 32, .. } if tensor == "tensor.b"),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "`tensor.b`", "33", "q8_0"]);
}

#[test]
fn duplicate_tensor_name() {
    let mut bytes = sample_bytes();
    let at = tensor_info_at(&bytes, "tensor.b", 2);
    bytes[at.name + 8 + "tensor.".len()] = b'a';
    let err = parse(bytes).unwrap_err();
    assert!(
        matches!(&err, GgufError::DuplicateTensor { tensor, offset, .. } if tensor == "tensor.a" && *offset == at.name as u64),
        "{err}"
    );
    assert_mentions(&err, &[LABEL, "`tensor.a`", &format!("offset {}", at.name)]);
}

#[test]
fn io_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-model.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    assert!(
        matches!(&err, GgufError::Io { path, .. } if path == &missing),
        "{err}"
    );
    assert_mentions(&err, &["no-such-model.gguf"]);

    let err = GgufFile::open(dir.path()).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err}");

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let err = GgufFile::open(&empty).unwrap_err();
    assert!(
        matches!(err, GgufError::Truncated { offset: 0, .. }),
        "{err}"
    );
    assert_mentions(&err, &["empty.gguf", "magic"]);
}

#[test]
fn every_truncation_fails_without_panicking() {
    let bytes = sample_bytes();
    for len in 0..bytes.len() {
        let err = match parse(bytes[..len].to_vec()) {
            Ok(_) => panic!("a file truncated to {len} of {} bytes parsed", bytes.len()),
            Err(err) => err,
        };
        assert!(
            matches!(
                err,
                GgufError::Truncated { .. }
                    | GgufError::StringTooLong { .. }
                    | GgufError::CountTooLarge { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "truncated to {len}: {err}"
        );
        assert_mentions(&err, &[LABEL]);
    }
}
