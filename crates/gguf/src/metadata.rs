//! [`Metadata`]: the key/value section of a GGUF file, in file order with lookup by key, and the
//! typed accessors model code reads hyperparameters through. Integer accessors accept any
//! integer type whose value fits (llama.cpp writers disagree on u32 vs i32); every error names
//! the key. `arch_*` accessors prefix the key with `general.architecture`.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::error::{GgufError, Result};
use crate::value::{Array, StringArray, Value};

/// The key naming the model architecture; `arch_*` accessors read `<arch>.<suffix>`.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// The key that sets the data alignment (u32, power of two).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Alignment used when a file does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// Metadata entries in insertion (file) order; keys are unique.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            entries: Vec::with_capacity(n),
            index: HashMap::with_capacity(n),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value under `key`, or [`GgufError::MissingKey`].
    pub fn value(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
        })
    }

    /// Appends an entry; fails with [`GgufError::DuplicateMetadataKey`] if the key exists.
    pub fn push(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateMetadataKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value.into()));
        Ok(())
    }

    /// Sets `key`, replacing an existing value in place (keeping its position) or appending.
    /// Returns the previous value.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Option<Value> {
        let key = key.into();
        let value = value.into();
        match self.index.get(&key) {
            Some(&i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
                None
            }
        }
    }

    /// `general.architecture`.
    pub fn arch(&self) -> Result<&str> {
        self.str(ARCHITECTURE_KEY)
    }

    /// `<arch>.<suffix>`, e.g. `llama.block_count` for `arch_key("block_count")`.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.arch()?))
    }

    /// Any integer value converted to `T`, failing if it is not an integer or does not fit.
    pub fn integer<T: TryFrom<i128>>(&self, key: &str) -> Result<T> {
        to_integer(key, self.value(key)?)
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        expected,
        found: found.type_description(),
    }
}

fn to_integer<T: TryFrom<i128>>(key: &str, value: &Value) -> Result<T> {
    let target = std::any::type_name::<T>();
    let wide = value
        .as_integer()
        .ok_or_else(|| wrong_type(key, "integer", value))?;
    T::try_from(wide).map_err(|_| GgufError::ValueOutOfRange {
        key: key.to_string(),
        value: wide.to_string(),
        target,
    })
}

fn to_u32(key: &str, value: &Value) -> Result<u32> {
    to_integer(key, value)
}

fn to_u64(key: &str, value: &Value) -> Result<u64> {
    to_integer(key, value)
}

fn to_i32(key: &str, value: &Value) -> Result<i32> {
    to_integer(key, value)
}

fn to_i64(key: &str, value: &Value) -> Result<i64> {
    to_integer(key, value)
}

/// f32, or f64 narrowed (some converters write f64 for epsilons and rope bases).
fn to_f32(key: &str, value: &Value) -> Result<f32> {
    match *value {
        Value::F32(v) => Ok(v),
        Value::F64(v) => Ok(v as f32),
        _ => Err(wrong_type(key, "f32", value)),
    }
}

fn to_f64(key: &str, value: &Value) -> Result<f64> {
    match *value {
        Value::F32(v) => Ok(v.into()),
        Value::F64(v) => Ok(v),
        _ => Err(wrong_type(key, "f64", value)),
    }
}

fn to_bool(key: &str, value: &Value) -> Result<bool> {
    match *value {
        Value::Bool(v) => Ok(v),
        _ => Err(wrong_type(key, "bool", value)),
    }
}

fn to_str<'a>(key: &str, value: &'a Value) -> Result<&'a str> {
    value
        .as_str()
        .ok_or_else(|| wrong_type(key, "string", value))
}

fn to_array<'a>(key: &str, value: &'a Value) -> Result<&'a Array> {
    value
        .as_array()
        .ok_or_else(|| wrong_type(key, "array", value))
}

fn to_str_array<'a>(key: &str, value: &'a Value) -> Result<&'a StringArray> {
    match value {
        Value::Array(Array::String(v)) => Ok(v),
        _ => Err(wrong_type(key, "array of string", value)),
    }
}

fn to_f32_array<'a>(key: &str, value: &'a Value) -> Result<&'a [f32]> {
    match value {
        Value::Array(Array::F32(v)) => Ok(v),
        _ => Err(wrong_type(key, "array of f32", value)),
    }
}

/// An integer array as `[T]`: borrowed when the element type is exactly `T`, converted (with a
/// range check on every element) from any other integer element type.
fn to_int_array<'a, T: TryFrom<i128> + Clone>(
    key: &str,
    value: &'a Value,
    expected: &'static str,
    exact: impl FnOnce(&'a Array) -> Option<&'a [T]>,
) -> Result<Cow<'a, [T]>> {
    let array = value
        .as_array()
        .ok_or_else(|| wrong_type(key, expected, value))?;
    if let Some(items) = exact(array) {
        return Ok(Cow::Borrowed(items));
    }
    let mut out = Vec::with_capacity(array.len());
    for i in 0..array.len() {
        let wide = array
            .integer_at(i)
            .ok_or_else(|| wrong_type(key, expected, value))?;
        let item = T::try_from(wide).map_err(|_| GgufError::ValueOutOfRange {
            key: format!("{key}[{i}]"),
            value: wide.to_string(),
            target: std::any::type_name::<T>(),
        })?;
        out.push(item);
    }
    Ok(Cow::Owned(out))
}

fn to_u32_array<'a>(key: &str, value: &'a Value) -> Result<Cow<'a, [u32]>> {
    to_int_array(key, value, "array of integers", |a| match a {
        Array::U32(v) => Some(v.as_slice()),
        _ => None,
    })
}

fn to_i32_array<'a>(key: &str, value: &'a Value) -> Result<Cow<'a, [i32]>> {
    to_int_array(key, value, "array of integers", |a| match a {
        Array::I32(v) => Some(v.as_slice()),
        _ => None,
    })
}

/// For each type: `name(key)` (required), `get_name(key)` (`Ok(None)` when the key is absent,
/// an error when present with the wrong type), and the same pair prefixed with the
/// architecture (`arch_name("block_count")` reads `<arch>.block_count`).
macro_rules! accessors {
    ($( $what:literal: $name:ident, $get:ident, $arch:ident, $arch_opt:ident -> $ret:ty = $conv:path; )*) => {
        impl Metadata {$(
            #[doc = concat!("The ", $what, " under `key`.")]
            pub fn $name(&self, key: &str) -> Result<$ret> {
                $conv(key, self.value(key)?)
            }

            #[doc = concat!("The ", $what, " under `key`, or `None` when the key is absent.")]
            pub fn $get(&self, key: &str) -> Result<Option<$ret>> {
                self.get(key).map(|v| $conv(key, v)).transpose()
            }

            #[doc = concat!("The ", $what, " under `<arch>.<suffix>`.")]
            pub fn $arch(&self, suffix: &str) -> Result<$ret> {
                let key = self.arch_key(suffix)?;
                $conv(&key, self.value(&key)?)
            }

            #[doc = concat!("The ", $what, " under `<arch>.<suffix>`, or `None` when absent.")]
            pub fn $arch_opt(&self, suffix: &str) -> Result<Option<$ret>> {
                let key = self.arch_key(suffix)?;
                self.get(&key).map(|v| $conv(&key, v)).transpose()
            }
        )*}
    };
}

accessors! {
    "integer (any integer type that fits u32)": u32, get_u32, arch_u32, arch_u32_opt -> u32 = to_u32;
    "integer (any integer type that fits u64)": u64, get_u64, arch_u64, arch_u64_opt -> u64 = to_u64;
    "integer (any integer type that fits i32)": i32, get_i32, arch_i32, arch_i32_opt -> i32 = to_i32;
    "integer (any integer type that fits i64)": i64, get_i64, arch_i64, arch_i64_opt -> i64 = to_i64;
    "float (f32, or f64 narrowed)": f32, get_f32, arch_f32, arch_f32_opt -> f32 = to_f32;
    "float (f32 or f64)": f64, get_f64, arch_f64, arch_f64_opt -> f64 = to_f64;
    "bool": bool, get_bool, arch_bool, arch_bool_opt -> bool = to_bool;
    "string": str, get_str, arch_str, arch_str_opt -> &str = to_str;
    "array (any element type)": array, get_array, arch_array, arch_array_opt -> &Array = to_array;
    "array of strings": str_array, get_str_array, arch_str_array, arch_str_array_opt
        -> &StringArray = to_str_array;
    "array of f32": f32_array, get_f32_array, arch_f32_array, arch_f32_array_opt
        -> &[f32] = to_f32_array;
    "integer array as u32 (borrowed when stored as u32)": u32_array, get_u32_array,
        arch_u32_array, arch_u32_array_opt -> Cow<'_, [u32]> = to_u32_array;
    "integer array as i32 (borrowed when stored as i32)": i32_array, get_i32_array,
        arch_i32_array, arch_i32_array_opt -> Cow<'_, [i32]> = to_i32_array;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut m = Metadata::new();
        m.push(ARCHITECTURE_KEY, "qwen3moe").unwrap();
        m.push("qwen3moe.block_count", 48i32).unwrap();
        m.push("qwen3moe.expert_count", 128u16).unwrap();
        m.push("qwen3moe.rope.freq_base", 1e6f32).unwrap();
        m.push("qwen3moe.negative", -1i64).unwrap();
        m.push("layers", vec![1i32, 2, 3]).unwrap();
        m.push("tokens", vec!["a", "b"]).unwrap();
        m
    }

    #[test]
    fn integer_accessors_accept_any_fitting_integer_type() {
        let m = sample();
        assert_eq!(m.arch().unwrap(), "qwen3moe");
        assert_eq!(m.arch_u32("block_count").unwrap(), 48);
        assert_eq!(m.arch_u64("expert_count").unwrap(), 128);
        assert_eq!(m.arch_i32("negative").unwrap(), -1);
        assert_eq!(m.arch_f32("rope.freq_base").unwrap(), 1e6);
        assert_eq!(m.u32_array("layers").unwrap().as_ref(), &[1, 2, 3]);
        assert!(matches!(m.i32_array("layers").unwrap(), Cow::Borrowed(_)));
        assert_eq!(m.str_array("tokens").unwrap().to_vec(), ["a", "b"]);
    }

    #[test]
    fn accessor_errors_name_the_key_and_types() {
        let m = sample();
        let err = m.arch_u32("negative").unwrap_err();
        assert!(matches!(err, GgufError::ValueOutOfRange { .. }), "{err}");
        assert!(err.to_string().contains("qwen3moe.negative"), "{err}");

        let err = m.arch_bool("block_count").unwrap_err();
        assert!(
            matches!(&err, GgufError::WrongType { expected: "bool", found, .. } if found == "i32")
        );
        assert!(err.to_string().contains("qwen3moe.block_count"), "{err}");

        let err = m.arch_u32("missing").unwrap_err();
        assert!(matches!(&err, GgufError::MissingKey { key } if key == "qwen3moe.missing"));

        let err = m.u32_array("tokens").unwrap_err();
        assert!(err.to_string().contains("array of string"), "{err}");
    }

    #[test]
    fn optional_accessors_distinguish_absent_from_wrong_type() {
        let m = sample();
        assert_eq!(m.arch_u32_opt("missing").unwrap(), None);
        assert_eq!(m.get_u32("qwen3moe.block_count").unwrap(), Some(48));
        assert!(m.get_str("qwen3moe.block_count").is_err());
    }

    #[test]
    fn insertion_order_is_kept_and_insert_replaces_in_place() {
        let mut m = sample();
        assert!(m.push("layers", 1u8).is_err());
        assert_eq!(m.insert("qwen3moe.block_count", 2u32), Some(Value::I32(48)));
        assert_eq!(m.keys().nth(1), Some("qwen3moe.block_count"));
        assert_eq!(m.u32("qwen3moe.block_count").unwrap(), 2);
    }
}
