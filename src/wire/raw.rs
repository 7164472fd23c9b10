//! A JSON object's members read as raw JSON ([`RawMembers`]).

/// A JSON object's members in order, values left as raw JSON: read
/// without building a tree, so the bytes of each member can be kept as sent.
pub struct RawMembers<'a>(pub Vec<(String, &'a serde_json::value::RawValue)>);

impl<'de> serde::Deserialize<'de> for RawMembers<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Members;
        impl<'de> serde::de::Visitor<'de> for Members {
            type Value = RawMembers<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    out.push(entry);
                }
                Ok(RawMembers(out))
            }
        }
        d.deserialize_map(Members)
    }
}
