//! The text of an item read from its JSON bytes, without building its tree:
//! what [`super::TokenCounter`] counts of a new item of a request whose items
//! are still the client's bytes (most requests). The same text, in the same
//! order, as [`super::Text::collect`] gives for the item parsed.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The member of reasoning and compaction items that carries their content
/// encrypted (Responses API, `include: ["reasoning.encrypted_content"]`).
pub(super) const SEALED_FIELD: &str = "encrypted_content";

/// What an item's counting needs besides its text.
#[derive(Default)]
pub(super) struct Facts {
    /// `role` and `type`, when they are strings.
    pub role: Option<String>,
    pub kind: Option<String>,
    /// The sealed field's string, held out of the text, and where in the
    /// text [`HELD`] stands for it (so that what follows is separated from
    /// it as from any text): the caller puts it back, or takes it out when
    /// the item's type is one whose payload is sealed (its `type` may come
    /// after it).
    pub sealed: Option<(usize, String)>,
    /// A string naming a media block's type was seen
    /// ([`super::media::is_block_type`]): the item may hold an image or a
    /// document, which this text does not tell from words.
    pub media: bool,
}

/// Appends the string leaves of one JSON item to `out`, space separated
/// (values, not keys, as [`super::Text::collect`]), and returns its facts.
/// `None` when `json` is not one JSON value.
pub(super) fn item_text(json: &[u8], out: &mut String) -> Option<Facts> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let mut sink = Out {
        text: out,
        media: false,
    };
    let mut facts = Item(&mut sink).deserialize(&mut de).ok()?;
    de.end().ok()?;
    facts.media = sink.media;
    Some(facts)
}

/// Where the text goes, and whether a media block's type was seen.
struct Out<'a> {
    text: &'a mut String,
    media: bool,
}

/// What stands in the text for the sealed field's string while the
/// item's type is not known yet: one byte, found by its place, not by
/// its value.
const HELD: &str = "\u{1}";

/// Puts `s` in the place [`HELD`] holds at `at`, as
/// [`super::Text::collect`] would have added it.
pub(super) fn put_back(out: &mut String, at: usize, s: &str) {
    out.replace_range(at..at + HELD.len(), s);
}

/// Takes [`HELD`] at `at` out with the space that separates it, as
/// [`super::Text::collect`] leaves a sealed payload out.
pub(super) fn take_out(out: &mut String, at: usize) {
    let end = at + HELD.len();
    if at > 0 {
        out.replace_range(at - 1..end, "");
    } else {
        let end = if out[end..].starts_with(' ') {
            end + 1
        } else {
            end
        };
        out.replace_range(at..end, "");
    }
}

fn push(out: &mut Out, s: &str) {
    out.media |= super::media::is_block_type(s);
    if !out.text.is_empty() {
        out.text.push(' ');
    }
    out.text.push_str(s);
}

/// Every string leaf of a value.
struct Texts<'a, 'b>(&'a mut Out<'b>);

impl<'de> DeserializeSeed<'de> for Texts<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// The leaves that are not strings add nothing.
macro_rules! no_text {
    ($value:ty, $none:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<$value, E> {
            Ok($none)
        }
        fn visit_i64<E>(self, _: i64) -> Result<$value, E> {
            Ok($none)
        }
        fn visit_u64<E>(self, _: u64) -> Result<$value, E> {
            Ok($none)
        }
        fn visit_f64<E>(self, _: f64) -> Result<$value, E> {
            Ok($none)
        }
        fn visit_unit<E>(self) -> Result<$value, E> {
            Ok($none)
        }
    };
}

impl<'de> Visitor<'de> for Texts<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    no_text!((), ());

    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        push(self.0, s);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Texts(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(Texts(&mut *self.0))?;
        }
        Ok(())
    }
}

/// A value's text, and the value itself when it is a string (`role`,
/// `type`, the sealed field).
struct Kept<'a, 'b> {
    out: &'a mut Out<'b>,
    /// The string is kept out of the text.
    aside: bool,
}

impl<'a, 'b> Kept<'a, 'b> {
    fn new(out: &'a mut Out<'b>, aside: bool) -> Self {
        Kept { out, aside }
    }
}

impl<'de> DeserializeSeed<'de> for Kept<'_, '_> {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Kept<'_, '_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    no_text!(Option<String>, None);

    fn visit_str<E>(self, s: &str) -> Result<Option<String>, E> {
        push(self.out, if self.aside { HELD } else { s });
        // Held out of the text, a media type's name still tells.
        self.out.media |= super::media::is_block_type(s);
        Ok(Some(s.to_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<String>, A::Error> {
        Texts(self.out).visit_seq(seq).map(|()| None)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<String>, A::Error> {
        Texts(self.out).visit_map(map).map(|()| None)
    }
}

/// The members of an item that its counting looks at.
enum Key {
    Role,
    Type,
    Sealed,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E>(self, s: &str) -> Result<Key, E> {
                Ok(match s {
                    "role" => Key::Role,
                    "type" => Key::Type,
                    SEALED_FIELD => Key::Sealed,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// An item: its members' text, with its facts when it is an object.
struct Item<'a, 'b>(&'a mut Out<'b>);

impl<'de> DeserializeSeed<'de> for Item<'_, '_> {
    type Value = Facts;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Facts, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Item<'_, '_> {
    type Value = Facts;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    no_text!(Facts, Facts::default());

    fn visit_str<E>(self, s: &str) -> Result<Facts, E> {
        push(self.0, s);
        Ok(Facts::default())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Facts, A::Error> {
        Texts(self.0).visit_seq(seq).map(|()| Facts::default())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Facts, A::Error> {
        let out = self.0;
        let mut facts = Facts::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Role => facts.role = map.next_value_seed(Kept::new(out, false))?,
                Key::Type => facts.kind = map.next_value_seed(Kept::new(out, false))?,
                Key::Sealed => {
                    if let Some(s) = map.next_value_seed(Kept::new(out, true))? {
                        // A string: the last thing in the text is what
                        // holds its place.
                        facts.sealed = Some((out.text.len() - HELD.len(), s));
                    }
                }
                Key::Other => map.next_value_seed(Texts(&mut *out))?,
            }
        }
        Ok(facts)
    }
}
