//! Metadata values: the GGUF value-type ids, the [`Value`] enum for one metadata entry, typed
//! [`Array`]s (one `Vec` per element type, so a 150k-token vocabulary is one `Vec<String>` and a
//! float table one `Vec<f32>`), and their little-endian encoding, shared by the writer and the
//! fingerprint so both see exactly the bytes a file holds.

use std::fmt;
use std::ops::Index;

/// How deep arrays may nest (an array value at the top level is depth 1). GGUF files in the
/// wild use at most 2; the limit keeps a hostile file from recursing the reader off its stack.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// A metadata value type id as stored in GGUF (`enum gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes of one value of this type, or `None` for the variable-length string and array.
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one encoded value can take: a string is at least its u64 length, an
    /// array at least its element type (u32) and count (u64). Used to bound untrusted counts.
    pub fn min_encoded_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous array; arrays of arrays hold inner arrays that each carry their own type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(StringArray),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The type as a reader would describe it: `u32`, `string`, `array of string`.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(array) => array.type_description(),
            scalar => scalar.value_type().name().to_string(),
        }
    }

    /// The value as a wide integer when it is one of the eight integer types (not bool).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Appends the GGUF encoding of the value (without its type id) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Value::U8(v) => out.push(*v),
            Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Bool(v) => out.push(u8::from(*v)),
            Value::String(s) => encode_string(s, out),
            Value::Array(a) => a.encode(out),
            Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
}

/// Appends a GGUF string: u64 byte length, then the UTF-8 bytes.
pub(crate) fn encode_string(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode_all<T: Copy, const N: usize>(items: &[T], to_le: fn(T) -> [u8; N], out: &mut Vec<u8>) {
    out.reserve(items.len() * N);
    for &item in items {
        out.extend_from_slice(&to_le(item));
    }
}

impl Array {
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `array of u32`, `array of array`.
    pub fn type_description(&self) -> String {
        format!("array of {}", self.elem_type())
    }

    /// Nesting depth: 1 for an array of scalars, 1 + the deepest inner array otherwise.
    pub fn depth(&self) -> usize {
        match self {
            Array::Array(inner) => 1 + inner.iter().map(Array::depth).max().unwrap_or(0),
            _ => 1,
        }
    }

    /// Element `index` as an integer, when this is an array of one of the integer types.
    pub fn integer_at(&self, index: usize) -> Option<i128> {
        Some(match self {
            Array::U8(v) => (*v.get(index)?).into(),
            Array::I8(v) => (*v.get(index)?).into(),
            Array::U16(v) => (*v.get(index)?).into(),
            Array::I16(v) => (*v.get(index)?).into(),
            Array::U32(v) => (*v.get(index)?).into(),
            Array::I32(v) => (*v.get(index)?).into(),
            Array::U64(v) => (*v.get(index)?).into(),
            Array::I64(v) => (*v.get(index)?).into(),
            _ => return None,
        })
    }

    /// Appends the GGUF encoding: element type id (u32), count (u64), elements.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.elem_type().id().to_le_bytes());
        out.extend_from_slice(&(self.len() as u64).to_le_bytes());
        match self {
            Array::U8(v) => out.extend_from_slice(v),
            Array::I8(v) => encode_all(v, i8::to_le_bytes, out),
            Array::U16(v) => encode_all(v, u16::to_le_bytes, out),
            Array::I16(v) => encode_all(v, i16::to_le_bytes, out),
            Array::U32(v) => encode_all(v, u32::to_le_bytes, out),
            Array::I32(v) => encode_all(v, i32::to_le_bytes, out),
            Array::F32(v) => encode_all(v, f32::to_le_bytes, out),
            Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
            Array::String(v) => {
                out.reserve(v.text.len() + 8 * v.len());
                v.iter().for_each(|s| encode_string(s, out));
            }
            Array::Array(v) => v.iter().for_each(|a| a.encode(out)),
            Array::U64(v) => encode_all(v, u64::to_le_bytes, out),
            Array::I64(v) => encode_all(v, i64::to_le_bytes, out),
            Array::F64(v) => encode_all(v, f64::to_le_bytes, out),
        }
    }
}

macro_rules! value_from {
    ($($ty:ty => $variant:ident),* $(,)?) => {$(
        impl From<$ty> for Value {
            fn from(v: $ty) -> Self {
                Value::$variant(v)
            }
        }
        impl From<Vec<$ty>> for Array {
            fn from(v: Vec<$ty>) -> Self {
                Array::$variant(v)
            }
        }
        impl From<Vec<$ty>> for Value {
            fn from(v: Vec<$ty>) -> Self {
                Value::Array(Array::$variant(v))
            }
        }
    )*};
}

value_from! {
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, u64 => U64, i64 => I64, f64 => F64,
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::String(v)
    }
}

impl From<StringArray> for Array {
    fn from(v: StringArray) -> Self {
        Array::String(v)
    }
}

impl From<StringArray> for Value {
    fn from(v: StringArray) -> Self {
        Value::Array(Array::String(v))
    }
}

impl From<Vec<String>> for Array {
    fn from(v: Vec<String>) -> Self {
        Array::String(v.into_iter().collect())
    }
}

impl From<Vec<String>> for Value {
    fn from(v: Vec<String>) -> Self {
        Value::Array(v.into())
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::String(v.to_string())
    }
}

impl From<Array> for Value {
    fn from(v: Array) -> Self {
        Value::Array(v)
    }
}

impl From<Vec<Array>> for Array {
    fn from(v: Vec<Array>) -> Self {
        Array::Array(v)
    }
}

impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Self {
        Value::Array(Array::Array(v))
    }
}

impl From<Vec<&str>> for Array {
    fn from(v: Vec<&str>) -> Self {
        Array::String(v.into_iter().collect())
    }
}

impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Self {
        Value::Array(v.into())
    }
}

/// An array of strings stored back to back in one buffer, with the end offset of each: a
/// vocabulary of 262k tokens and 515k merges parses into two allocations instead of 777k.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct StringArray {
    text: String,
    ends: Vec<usize>,
}

impl StringArray {
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `n_strings` strings totalling `n_bytes` bytes.
    pub fn with_capacity(n_strings: usize, n_bytes: usize) -> Self {
        Self {
            text: String::with_capacity(n_bytes),
            ends: Vec::with_capacity(n_strings),
        }
    }

    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `index`, or `None` past the end.
    pub fn get(&self, index: usize) -> Option<&str> {
        let end = *self.ends.get(index)?;
        let start = if index == 0 { 0 } else { self.ends[index - 1] };
        self.text.get(start..end)
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + DoubleEndedIterator + Clone {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }

    /// Bytes of all strings together.
    pub fn text_len(&self) -> usize {
        self.text.len()
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_string).collect()
    }
}

impl Index<usize> for StringArray {
    type Output = str;

    /// Panics when `index` is out of bounds, like slice indexing.
    fn index(&self, index: usize) -> &str {
        match self.get(index) {
            Some(s) => s,
            None => panic!("string index {index} out of bounds (len {})", self.len()),
        }
    }
}

impl fmt::Debug for StringArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for StringArray {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut out = StringArray::new();
        iter.into_iter().for_each(|s| out.push(s.as_ref()));
        out
    }
}

impl<'a> IntoIterator for &'a StringArray {
    type Item = &'a str;
    type IntoIter = Box<dyn Iterator<Item = &'a str> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}
