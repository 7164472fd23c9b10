//! An item's `role` and `type` read from its JSON bytes, every other
//! member skipped unbuilt: what kind of item it is, without the tree of
//! its text (a system prompt or a tool's output is kilobytes of it).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

/// The `role` and `type` text members of the JSON object `bytes` (empty
/// when missing or `null`), as `Value::get(..).and_then(Value::as_str)`
/// reads them, the last of a repeated member winning. `None` for what
/// that reading could disagree with: not an object, a member that is
/// neither text nor `null`, bad JSON; the caller then parses the item.
pub(super) fn role_and_type(bytes: &[u8]) -> Option<(Cow<'_, str>, Cow<'_, str>)> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let found = de.deserialize_map(RoleAndType).ok()?;
    de.end().ok()?;
    Some(found)
}

struct RoleAndType;

impl<'de> Visitor<'de> for RoleAndType {
    type Value = (Cow<'de, str>, Cow<'de, str>);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut role, mut kind) = (Cow::Borrowed(""), Cow::Borrowed(""));
        while let Some(Text(key)) = map.next_key::<Text<'de>>()? {
            match &*key {
                "role" => {
                    role = map
                        .next_value::<Option<Text<'de>>>()?
                        .map_or_else(Cow::default, |t| t.0)
                }
                "type" => {
                    kind = map
                        .next_value::<Option<Text<'de>>>()?
                        .map_or_else(Cow::default, |t| t.0)
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok((role, kind))
    }
}

/// A JSON string, borrowed from the bytes unless it has escapes.
struct Text<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Text(Cow::Borrowed(s)))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Text(Cow::Owned(s.to_string())))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Text(Cow::Owned(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// What reading the parsed item gives.
    fn parsed(bytes: &str) -> (String, String) {
        let v: Value = serde_json::from_str(bytes).unwrap_or_default();
        let member = |m: &str| v.get(m).and_then(Value::as_str).unwrap_or("").to_string();
        (member("role"), member("type"))
    }

    #[test]
    fn reads_what_the_parsed_item_reads_or_leaves_it_to_the_parse() {
        for item in [
            r#"{"role":"assistant","content":"x"}"#,
            r#"{"type":"function_call","name":"f","arguments":"{}"}"#,
            r#"{"content":[{"type":"text","role":"user"}],"role":"user"}"#,
            r#"{"role":"us\u0065r","type":null}"#,
            r#"{"role":"user","role":"assistant"}"#,
            r#"{"role":"tool","content":{"nested":["role",{"role":"assistant"}]}}"#,
            r#"{}"#,
        ] {
            let (role, kind) = role_and_type(item.as_bytes()).expect(item);
            assert_eq!(
                (role.into_owned(), kind.into_owned()),
                parsed(item),
                "{item}"
            );
        }
        // Left to the parse: not an object, a member that is not text,
        // bytes after the object, bad JSON.
        for item in [
            r#"["assistant","message"]"#,
            r#"{"role":5}"#,
            r#"{"type":{"x":1}}"#,
            r#"{"role":"user"} x"#,
            r#"{"role":"user""#,
            "\"user\"",
        ] {
            assert!(role_and_type(item.as_bytes()).is_none(), "{item}");
        }
    }
}
