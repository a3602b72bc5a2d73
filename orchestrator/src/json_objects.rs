//! Reading a JSON tree into a type where every struct is written as an object.
//!
//! serde's derived structs also take an array of their fields in declaration order (`[1]` for
//! `{"max_items": 1}`). The API document allows only objects, and a client that sent arrays
//! would break on the next added field, so a body that writes any struct that way is refused.
//! Everything else reads as serde_json reads a `Value`; an enum's content (the API's enums are
//! plain strings) is read by serde_json itself.

use serde::de::value::BorrowedStrDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Unexpected, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::{Error, Value};

/// `T` read from `value`, refusing a struct written as anything but an object.
pub fn from_value<'de, T: de::Deserialize<'de>>(value: &'de Value) -> Result<T, Error> {
    T::deserialize(Objects(value))
}

#[derive(Clone, Copy)]
struct Objects<'de>(&'de Value);

impl<'de> Deserializer<'de> for Objects<'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => n.clone().deserialize_any(visitor),
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(items) => visitor.visit_seq(Items(items.iter())),
            Value::Object(fields) => visitor.visit_map(Fields {
                fields: fields.iter(),
                value: None,
            }),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self.0 {
            Value::Object(_) => self.deserialize_any(visitor),
            other => Err(de::Error::invalid_type(unexpected(other), &visitor)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map identifier
    }
}

fn unexpected(value: &Value) -> Unexpected<'_> {
    match value {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(_) => Unexpected::Other("a number"),
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

struct Items<'de>(std::slice::Iter<'de, Value>);

impl<'de> SeqAccess<'de> for Items<'de> {
    type Error = Error;

    fn next_element_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, Error> {
        self.0
            .next()
            .map(|item| seed.deserialize(Objects(item)))
            .transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Fields<'de> {
    fields: serde_json::map::Iter<'de>,
    value: Option<&'de Value>,
}

impl<'de> MapAccess<'de> for Fields<'de> {
    type Error = Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, Error> {
        let Some((key, value)) = self.fields.next() else {
            return Ok(None);
        };
        self.value = Some(value);
        seed.deserialize(BorrowedStrDeserializer::new(key))
            .map(Some)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Error> {
        let value = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("a value was read before its key"))?;
        seed.deserialize(Objects(value))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.fields.len())
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Inner {
        device: String,
        memory: u64,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Outer {
        max_items: u32,
        #[serde(default)]
        inner: Option<Inner>,
        #[serde(default)]
        list: Vec<Inner>,
        lease: uuid::Uuid,
    }

    fn read(text: &str) -> Result<Outer, Error> {
        let tree: Value = serde_json::from_str(text).expect("JSON");
        from_value(&tree)
    }

    #[test]
    fn objects_read_as_serde_json_reads_them() {
        let text = r#"{"max_items": 3, "inner": {"device": "cpu", "memory": 7},
            "list": [{"device": "a", "memory": 1}], "lease": "67e55044-10b1-426f-9247-bb680e5fe0c8",
            "extra": [1, {"x": null}]}"#;
        let strict = read(text).expect("objects");
        let plain: Outer = serde_json::from_str(text).expect("serde_json");
        assert_eq!(strict, plain);
        assert_eq!(strict.inner.as_ref().map(|i| i.memory), Some(7));
    }

    #[test]
    fn a_struct_written_as_an_array_is_refused_at_any_depth() {
        let lease = "\"67e55044-10b1-426f-9247-bb680e5fe0c8\"";
        for text in [
            format!("[3, null, [], {lease}]"),
            format!(r#"{{"max_items": 3, "inner": ["cpu", 7], "lease": {lease}}}"#),
            format!(r#"{{"max_items": 3, "list": [["a", 1]], "lease": {lease}}}"#),
        ] {
            // serde_json alone takes each of these.
            serde_json::from_str::<Outer>(&text).expect("serde_json reads arrays as structs");
            let err = read(&text).expect_err("an array where the document has an object");
            assert!(err.to_string().contains("invalid type: sequence"), "{err}");
        }
    }
}
