//! Metadata values and typed access to them.

use std::collections::BTreeMap;

use super::GgufError;

/// One metadata value. Arrays read from a file are homogeneous (GGUF stores one element
/// type per array); an empty array does not remember its element type.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The GGUF name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// Any integer variant, widened; `None` for everything else.
    pub fn as_i128(&self) -> Option<i128> {
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

    /// Describes the value for a `WrongType` error without dumping a whole array.
    fn describe(&self) -> String {
        match self {
            Value::Array(items) => match items.first() {
                Some(first) => format!("an array of {} {}", items.len(), first.type_name()),
                None => "an empty array".to_owned(),
            },
            Value::String(_) => "a string".to_owned(),
            other => match other.as_i128() {
                Some(v) => format!("{} {v}", other.type_name()),
                None => format!("{} {other:?}", other.type_name()),
            },
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for Value {
            fn from(v: $t) -> Self {
                Value::$v(v)
            }
        })*
    };
}

value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, bool => Bool, String => String);

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::String(v.to_owned())
    }
}

impl<T: Into<Value>> From<Vec<T>> for Value {
    fn from(v: Vec<T>) -> Self {
        Value::Array(v.into_iter().map(Into::into).collect())
    }
}

impl<T: Clone + Into<Value>> From<&[T]> for Value {
    fn from(v: &[T]) -> Self {
        Value::Array(v.iter().cloned().map(Into::into).collect())
    }
}

/// A file's key/value metadata, with typed getters whose errors name the key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata(pub(crate) BTreeMap<String, Value>);

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    /// Sets `key`, returning the value it replaces.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Option<Value> {
        self.0.insert(key.into(), value.into())
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })
    }

    /// Any integer type whose value fits in `u32` (files disagree on u32/i32/u64 for counts).
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        int_as(key, self.require(key)?, "an integer that fits in u32")
    }

    /// Any integer type whose value fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        int_as(key, self.require(key)?, "an integer that fits in u64")
    }

    /// `F32`, or `F64` narrowed to `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.require(key)? {
            Value::F32(v) => Ok(*v),
            Value::F64(v) => Ok(*v as f32),
            other => Err(wrong(key, "f32 or f64", other)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            other => Err(wrong(key, "a string", other)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            other => Err(wrong(key, "a bool", other)),
        }
    }

    /// An array of strings (an empty array is accepted whatever its stored element type).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let items = self.get_array(key, "an array of strings")?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong_elem(key, "an array of strings", i, other)),
            })
            .collect()
    }

    /// An array of any integer type whose elements fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        const EXPECTED: &str = "an array of integers that fit in i32";
        let items = self.get_array(key, EXPECTED)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i128()
                    .and_then(|n| i32::try_from(n).ok())
                    .ok_or_else(|| wrong_elem(key, EXPECTED, i, v))
            })
            .collect()
    }

    /// An array of numbers as `f32` (SentencePiece scores; some converters write integers).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const EXPECTED: &str = "an array of numbers";
        let items = self.get_array(key, EXPECTED)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::F32(x) => Ok(*x),
                Value::F64(x) => Ok(*x as f32),
                other => other
                    .as_i128()
                    .map(|n| n as f32)
                    .ok_or_else(|| wrong_elem(key, EXPECTED, i, v)),
            })
            .collect()
    }

    fn get_array(&self, key: &str, expected: &'static str) -> Result<&[Value], GgufError> {
        match self.require(key)? {
            Value::Array(items) => Ok(items),
            other => Err(wrong(key, expected, other)),
        }
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.optional(key, Self::get_u32)
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.optional(key, Self::get_u64)
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.optional(key, Self::get_f32)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.optional(key, Self::get_str)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.optional(key, Self::get_bool)
    }

    fn optional<'a, T>(
        &'a self,
        key: &str,
        get: impl FnOnce(&'a Self, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl<K: Into<String>, V: Into<Value>> FromIterator<(K, V)> for Metadata {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Metadata(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

fn int_as<T: TryFrom<i128>>(key: &str, v: &Value, expected: &'static str) -> Result<T, GgufError> {
    v.as_i128()
        .and_then(|i| T::try_from(i).ok())
        .ok_or_else(|| wrong(key, expected, v))
}

fn wrong(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.describe(),
    }
}

fn wrong_elem(key: &str, expected: &'static str, index: usize, elem: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: format!("an array whose element {index} is {}", elem.describe()),
    }
}
