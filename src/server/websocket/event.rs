//! The client events of a Responses WebSocket: what a `response.create`
//! (or a warm-up) asks, read without parsing its items, and the body of the
//! `POST /v1/responses` it stands for.
//!
//! A socket's next `response.create` repeats its last one byte for byte up
//! to where `input` grows (a conversation's next turn: the same model,
//! instructions and history, new items at the end of `input`, the same
//! members after it). So the socket keeps where the last one's members and
//! `input`'s items sit ([`Last`]): those wholly inside the bytes the two
//! share are taken as they were, and only what follows is parsed. A message
//! that does not read as such an object is parsed whole, as the first one
//! is, and judged (and refused) by that parse.

use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::wire::items::common_prefix;
use crate::wire::RawMembers;

/// A warm-up the session answered: its response id, and its input items
/// (the JSON of an array's members).
pub(super) struct Warmed {
    pub(super) id: String,
    pub(super) input: String,
}

/// What a client event asks.
#[cfg_attr(test, derive(Debug, PartialEq))]
pub(super) enum ClientEvent {
    /// A response: the body of its request.
    Create(Vec<u8>),
    /// A warm-up: its model and input items.
    WarmUp { model: String, input: String },
    /// Nothing.
    Nothing,
}

/// The socket's last `response.create`: its text and where its members sit.
#[derive(Default)]
#[cfg_attr(test, derive(Debug))]
pub(super) struct Last {
    text: String,
    outline: Outline,
}

/// Where an object's members sit in its text.
#[derive(Default, Clone)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Outline {
    /// Each member's key and the span of its value, in order.
    members: Vec<(String, Range<usize>)>,
    /// The first `input` member whose value is an array: its index among
    /// the members and the spans of its items.
    input: Option<(usize, Vec<Range<usize>>)>,
}

/// A client event: the request a `response.create` stands for (with the
/// input of the warm-up it continues, if it continues `warmed`), or why it
/// is refused. A `response.create` becomes `last`, which the next message
/// is read against.
pub(super) fn read_event(
    text: &str,
    warmed: Option<&Warmed>,
    last: &mut Last,
) -> Result<ClientEvent, (&'static str, String)> {
    let outline = match outline(text, last) {
        Some(outline) => outline,
        None => whole(text).map_err(|e| {
            (
                "invalid_json",
                format!("the message is not a JSON object: {e}"),
            )
        })?,
    };
    let member = |name: &str| {
        outline
            .members
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| &text[v.clone()])
    };
    let string = |name: &str| member(name).and_then(|v| serde_json::from_str::<String>(v).ok());
    match string("type").as_deref() {
        Some("response.create") => {}
        // Codex's acknowledgement of an answer it has read: nothing to do.
        Some("response.processed") => return Ok(ClientEvent::Nothing),
        Some(t) => {
            return Err((
                "unsupported_event",
                format!("unsupported event type `{t}`: this socket takes `response.create`"),
            ))
        }
        None => {
            return Err((
                "unsupported_event",
                "the event has no `type`: this socket takes `response.create`".into(),
            ))
        }
    }
    let event = if member("generate") == Some("false") {
        ClientEvent::WarmUp {
            model: string("model").unwrap_or_default(),
            input: member("input").map_or_else(String::new, items_of),
        }
    } else {
        let continues =
            warmed.filter(|w| string("previous_response_id").is_some_and(|p| p == w.id));
        ClientEvent::Create(request_body(text, &outline.members, continues))
    };
    last.text.clear();
    last.text.push_str(text);
    last.outline = outline;
    Ok(event)
}

/// The items of an `input` (JSON): an array's members, or a string as the
/// user message it stands for.
fn items_of(input: &str) -> String {
    let input = input.trim();
    if let Some(inner) = input.strip_prefix('[').and_then(|i| i.strip_suffix(']')) {
        return inner.trim().to_string();
    }
    if input.starts_with('"') {
        return format!(r#"{{"role":"user","content":{input}}}"#);
    }
    input.to_string()
}

/// The outline of an object's text, its members and `input`'s items taken
/// from `last` while they lie wholly inside the bytes the two share, and a
/// byte past their end too (so that a number is not cut short), and parsed
/// from the first that does not; past the end of `input`, the members that
/// follow it are taken too if all that follows it is as last time. `None`
/// if the rest does not read as the end of a JSON object (nor the text as
/// one, with nothing taken).
fn outline(text: &str, last: &Last) -> Option<Outline> {
    let same = common_prefix(last.text.as_bytes(), text.as_bytes());
    let old = &last.outline;
    let kept = old.members.partition_point(|(_, v)| v.end < same);
    let mut out = Outline {
        members: old.members[..kept].to_vec(),
        input: old.input.as_ref().filter(|(i, _)| *i < kept).cloned(),
    };
    let mut p = Parser { text, at: 0 };
    match &old.input {
        // Inside `input`, its `[` shared: from its first item not taken.
        Some((i, items)) if *i == kept && old.members[kept].1.start < same => {
            let (key, value) = &old.members[kept];
            let n = items.partition_point(|s| s.end < same);
            p.at = n.checked_sub(1).map_or(value.start + 1, |j| items[j].end);
            out.input = Some((kept, p.items(items[..n].to_vec())?));
            let end = p.at;
            out.members.push((key.clone(), value.start..end));
            // The rest of the text as the rest of the last one: its members
            // too, moved by as much as `input` grew.
            if text.as_bytes()[end..] == last.text.as_bytes()[value.end..] {
                let moved = |v: &Range<usize>| v.start - value.end + end..v.end - value.end + end;
                let after = old.members[kept + 1..].iter();
                out.members
                    .extend(after.map(|(k, v)| (k.clone(), moved(v))));
                return Some(out);
            }
        }
        _ => match kept.checked_sub(1) {
            Some(k) => p.at = old.members[k].1.end,
            None => p.eat(b'{').then_some(())?,
        },
    }
    p.members(&mut out)?;
    Some(out)
}

/// The outline of an object's text by serde_json's parse of its members
/// (no items), or its error.
fn whole(text: &str) -> Result<Outline, serde_json::Error> {
    let members = serde_json::from_str::<RawMembers<'_>>(text)?.0;
    let members = members
        .into_iter()
        .map(|(k, v)| {
            let start = v.get().as_ptr() as usize - text.as_ptr() as usize;
            (k, start..start + v.get().len())
        })
        .collect();
    Ok(Outline {
        members,
        input: None,
    })
}

/// Reads the structure of an object from a point on: the punctuation and
/// whitespace by hand, each key and value by serde_json (its bytes
/// checked as it checks them, inside the object).
struct Parser<'a> {
    text: &'a str,
    at: usize,
}

impl Parser<'_> {
    /// Past whitespace (JSON's).
    fn space(&mut self) {
        let bytes = self.text.as_bytes();
        while bytes
            .get(self.at)
            .is_some_and(|b| matches!(b, b' ' | b'\n' | b'\r' | b'\t'))
        {
            self.at += 1;
        }
    }

    /// Past whitespace, then past `byte` if it is next.
    fn eat(&mut self, byte: u8) -> bool {
        self.space();
        let next = self.text.as_bytes().get(self.at) == Some(&byte);
        self.at += usize::from(next);
        next
    }

    /// The span of the next value (after whitespace).
    fn value(&mut self) -> Option<Range<usize>> {
        let rest = &self.text[self.at..];
        let raw = <&RawValue>::deserialize(&mut serde_json::Deserializer::from_str(rest))
            .ok()?
            .get();
        let start = self.at + (raw.as_ptr() as usize - rest.as_ptr() as usize);
        self.at = start + raw.len();
        Some(start..self.at)
    }

    /// The rest of an array or object from after its opening (`started`:
    /// after one of its elements): each element read by `element`, past
    /// `close`.
    fn rest_of(
        &mut self,
        started: bool,
        close: u8,
        mut element: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        if !started {
            if self.eat(close) {
                return Some(());
            }
            element(self)?;
        }
        while !self.eat(close) {
            self.eat(b',').then_some(())?;
            element(self)?;
        }
        Some(())
    }

    /// An array's items from after its `[` (or after `items`, its first
    /// ones): the spans of all of them, past its `]`.
    fn items(&mut self, mut items: Vec<Range<usize>>) -> Option<Vec<Range<usize>>> {
        self.rest_of(!items.is_empty(), b']', |p| {
            items.push(p.value()?);
            Some(())
        })?;
        Some(items)
    }

    /// An object's members from after its `{` (or after `out`'s, its first
    /// ones), past its `}`, which ends the text.
    fn members(&mut self, out: &mut Outline) -> Option<()> {
        self.rest_of(!out.members.is_empty(), b'}', |p| p.member(out))?;
        self.space();
        (self.at == self.text.len()).then_some(())
    }

    /// A member: its key, and its value's span (and the items' of the first
    /// `input` that is an array).
    fn member(&mut self, out: &mut Outline) -> Option<()> {
        let key = &self.text[self.value()?];
        let key = match key.strip_prefix('"').and_then(|k| k.strip_suffix('"')) {
            Some(k) if !k.contains('\\') => k.to_owned(),
            Some(_) => serde_json::from_str(key).ok()?,
            None => return None,
        };
        self.eat(b':').then_some(())?;
        let value = if key == "input" && out.input.is_none() && self.eat(b'[') {
            let start = self.at - 1;
            out.input = Some((out.members.len(), self.items(Vec::new())?));
            start..self.at
        } else {
            self.value()?
        };
        out.members.push((key, value));
        Some(())
    }
}

/// The body of the `POST /v1/responses` a `response.create` stands for:
/// its members but `type`, streamed.
fn request_body(
    text: &str,
    members: &[(String, Range<usize>)],
    warmed: Option<&Warmed>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + warmed.map_or(0, |w| w.input.len()) + 16);
    out.push(b'{');
    for (k, v) in members {
        let skip = match k.as_str() {
            "type" | "stream" | "generate" => true,
            // The warm-up's id, which nobody upstream knows.
            "previous_response_id" => warmed.is_some(),
            _ => false,
        };
        if skip {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        // A key that came from JSON serializes back.
        let _ = serde_json::to_writer(&mut out, k);
        out.push(b':');
        let value = &text[v.clone()];
        match warmed {
            Some(w) if k == "input" => {
                let own = items_of(value);
                out.push(b'[');
                out.extend_from_slice(w.input.as_bytes());
                if !w.input.is_empty() && !own.is_empty() {
                    out.push(b',');
                }
                out.extend_from_slice(own.as_bytes());
                out.push(b']');
            }
            _ => out.extend_from_slice(value.as_bytes()),
        }
    }
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"stream\":true}");
    out
}

/// Whether an event ends a response.
pub(super) fn is_final(name: &str, data: &str) -> bool {
    const FINAL: [&str; 4] = [
        "response.completed",
        "response.failed",
        "response.incomplete",
        "error",
    ];
    if FINAL.contains(&name) {
        return true;
    }
    // Named by its `type` alone (no `event:` line).
    name == "message"
        && serde_json::from_str::<TypeOnly>(data).is_ok_and(|t| FINAL.contains(&t.kind.as_str()))
}

#[derive(serde::Deserialize)]
struct TypeOnly {
    #[serde(rename = "type")]
    kind: String,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Reads `texts` in turn on one socket, and each alone, and checks
    /// that both give the same event and leave the same `Last`.
    fn same_as_alone(texts: &[String], warmed: Option<&Warmed>) {
        let mut last = Last::default();
        for text in texts {
            // What the parse takes over is what it finds (not only once
            // the parse from the start had to judge the message).
            if let Some(o) = outline(text, &last) {
                assert_eq!(Some(o), outline(text, &Last::default()), "{text}");
            }
            let mut alone = Last::default();
            assert_eq!(
                read_event(text, warmed, &mut last),
                read_event(text, warmed, &mut alone),
                "{text}"
            );
            if alone.text == *text {
                assert_eq!(last.text, alone.text);
                assert_eq!(last.outline, alone.outline, "{text}");
            }
        }
        // The parse from the start reads what serde_json's does.
        for text in texts {
            assert_eq!(
                outline(text, &Last::default()).map(|o| o.members),
                whole(text).ok().map(|o| o.members),
                "{text}"
            );
        }
    }

    fn texts(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|t| (*t).to_owned()).collect()
    }

    #[test]
    fn a_growing_input_reads_as_alone() {
        same_as_alone(
            &texts(&[
                r#"{"type":"response.create","model":"m","input":[{"a":1}],"tools":[]}"#,
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2}],"tools":[]}"#,
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2},3],"tools":[]}"#,
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2},3],"n":5}"#,
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2},3],"n":50}"#,
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2},34]}"#,
                r#"{"type":"response.create","model":"m","input":[],"x":1}"#,
                r#"{"type":"response.create","model":"m","input":[ ]}"#,
            ]),
            None,
        );
    }

    #[test]
    fn a_changed_earlier_byte_reads_as_alone() {
        same_as_alone(
            &texts(&[
                r#"{"type":"response.create","model":"m","input":[{"a":1},{"b":2}]}"#,
                r#"{"type":"response.create","model":"n","input":[{"a":1},{"b":2}]}"#,
                r#"{"type":"response.create","model":"n","input":[{"a":2},{"b":2}]}"#,
                r#"{"type":"response.create" ,"model":"n","input":[{"a":2},{"b":2}]}"#,
                r#"{"type":"response.processed"}"#,
                r#"{"type":"response.create","model":"n","input":"hi"}"#,
                r#"{"type":"response.create","model":"n","input":"hi","input":[1]}"#,
            ]),
            None,
        );
    }

    #[test]
    fn a_broken_tail_is_refused_as_alone() {
        let first = r#"{"type":"response.create","input":[{"a":1}],"tools":[]}"#;
        for broken in [
            r#"{"type":"response.create","input":[{"a":1},]"#,
            r#"{"type":"response.create","input":[{"a":1},],"tools":[]}"#,
            r#"{"type":"response.create","input":[{"a":1}],"tools":[],}"#,
            r#"{"type":"response.create","input":[{"a":1}],"tools":[]}x"#,
            r#"{"type":"response.create","input":[{"a":1}],"tools":[]"#,
            r#"{"type":"response.create","input":[{"a":1}] "tools":[]}"#,
            r#"{"type":"response.create","input":[{"a":1}],tools:[]}"#,
            r#"{"type":"response.create","input":[{"a":1}],"\ud800":[]}"#,
        ] {
            let mut last = Last::default();
            assert!(read_event(first, None, &mut last).is_ok());
            let read = read_event(broken, None, &mut last);
            assert!(read.is_err(), "{broken}");
            assert_eq!(read, read_event(broken, None, &mut Last::default()));
        }
    }

    #[test]
    fn a_continued_warm_up_reads_as_alone() {
        let warmed = Warmed {
            id: "resp_w".into(),
            input: r#"{"w":1}"#.into(),
        };
        same_as_alone(
            &texts(&[
                r#"{"type":"response.create","generate":false,"model":"m","input":[{"a":1}]}"#,
                r#"{"type":"response.create","previous_response_id":"resp_w","input":[{"a":1}]}"#,
                r#"{"type":"response.create","previous_response_id":"resp_w","input":[{"a":1},2]}"#,
                r#"{"type":"response.create","previous_response_id":"resp_x","input":[{"a":1},2]}"#,
            ]),
            Some(&warmed),
        );
    }

    /// A JSON value as text, with whitespace from `ws` and strings with
    /// escapes and characters beyond ASCII.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            any::<i32>().prop_map(|n| n.to_string()),
            (any::<i16>(), 0u8..20).prop_map(|(m, e)| format!("{m}.5e{e}")),
            string(),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..4), space())
                    .prop_map(|(v, w)| format!("[{w}{}{w}]", v.join(&format!("{w},{w}")))),
                (prop::collection::vec((string(), inner), 0..4), space()).prop_map(|(m, w)| {
                    let m: Vec<String> = m
                        .into_iter()
                        .map(|(k, v)| format!("{k}{w}:{w}{v}"))
                        .collect();
                    format!("{{{w}{}{w}}}", m.join(&format!("{w},{w}")))
                }),
            ]
        })
    }

    /// A JSON string: some characters escaped as `\u` escapes.
    fn string() -> impl Strategy<Value = String> {
        prop::collection::vec((prop::sample::select(CHARS.to_vec()), any::<bool>()), 0..6).prop_map(
            |cs| {
                let mut out = String::from('"');
                for (c, escape) in cs {
                    match c {
                        c if escape && (c as u32) < 0x10000 => {
                            out.push_str(&format!("\\u{:04x}", c as u32))
                        }
                        c => {
                            let quoted = serde_json::to_string(&c.to_string()).unwrap();
                            out.push_str(&quoted[1..quoted.len() - 1]);
                        }
                    }
                }
                out.push('"');
                out
            },
        )
    }

    const CHARS: [char; 10] = ['a', 'z', ' ', '"', '\\', '\n', 'é', '中', '😀', '\u{1}'];

    fn space() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["", "", "", " ", "\n  ", "\t", "\r\n"])
    }

    /// A `response.create` of `members` (key, value) around `input`
    /// (at `at` among them) of `items`.
    fn message(members: &[(String, String)], at: usize, items: &[String], w: &str) -> String {
        let input = format!("[{w}{}{w}]", items.join(&format!(",{w}")));
        let mut all: Vec<String> = members
            .iter()
            .map(|(k, v)| format!("{k}{w}:{w}{v}"))
            .collect();
        all.insert(at.min(all.len()), format!("\"input\":{w}{input}"));
        format!("{w}{{{w}{}{w}}}{w}", all.join(&format!("{w},{w}")))
    }

    /// A member: a key Codex sends or another (escaped, not ASCII), and a
    /// value.
    fn member() -> impl Strategy<Value = (String, String)> {
        let key = prop_oneof![
            Just(r#""model""#.to_owned()),
            Just(r#""instructions""#.to_owned()),
            Just(r#""tools""#.to_owned()),
            Just(r#""stream""#.to_owned()),
            Just(r#""generate""#.to_owned()),
            Just(r#""previous_response_id""#.to_owned()),
            Just(r#""inp\u0075t""#.to_owned()),
            string(),
        ];
        (key, value())
    }

    /// An edit of a text: `len` bytes from `at` (a fraction of its length,
    /// moved on to the next `,`, `]` or `}` if `snap`: past a value, which
    /// a digit then lengthens) replaced by `by`.
    fn edit() -> impl Strategy<Value = (f64, bool, usize, &'static str)> {
        (
            0.0..1.0f64,
            any::<bool>(),
            0usize..4,
            prop::sample::select(vec![
                "",
                ",",
                "]",
                "}",
                "1",
                "0",
                ".5",
                "e1",
                " ",
                "\"x\"",
                "\\",
                "é",
                "{\"a\":1}",
            ]),
        )
    }

    fn apply(text: &str, (at, snap, len, by): (f64, bool, usize, &str)) -> String {
        let mut from = (text.len() as f64 * at) as usize;
        if snap {
            from += text.as_bytes()[from..]
                .iter()
                .position(|b| b",]}".contains(b))
                .unwrap_or(0);
        }
        let floor = |i: usize| {
            (0..=i)
                .rev()
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(0)
        };
        let from = floor(from);
        let to = floor((from + len * usize::from(!snap)).min(text.len()));
        format!("{}{by}{}", &text[..from], &text[to..])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Messages whose input grows, with members in any order, some
        /// of them edited anywhere (a byte changed, the tail cut or
        /// broken), read in turn as each is alone.
        #[test]
        fn messages_read_in_turn_as_alone(
            mut members in prop::collection::vec(member(), 0..6),
            kind in prop::sample::select(vec!["response.create", "response.create", "response.processed", "other"]),
            at in 0usize..7,
            items in prop::collection::vec(value(), 0..8),
            cuts in prop::collection::vec(0usize..8, 3),
            edits in prop::collection::vec(prop::option::weighted(0.5, edit()), 3),
            w in space(),
            warm in any::<bool>(),
        ) {
            members.insert(at.min(members.len()) / 2, (r#""type""#.to_owned(), format!("\"{kind}\"")));
            if warm {
                members.push((r#""previous_response_id""#.to_owned(), r#""resp_w""#.to_owned()));
            }
            let mut cuts = cuts;
            cuts.sort_unstable();
            let texts: Vec<String> = cuts
                .iter()
                .zip(&edits)
                .map(|(&n, e)| {
                    let text = message(&members, at, &items[..n.min(items.len())], w);
                    e.map_or(text.clone(), |e| apply(&text, e))
                })
                .collect();
            let warmed = Warmed { id: "resp_w".into(), input: r#"{"w":1}"#.into() };
            same_as_alone(&texts, warm.then_some(&warmed));
        }
    }
}
