//! Images, documents and audio in a request: estimated by what each API
//! charges for them, never tokenized as text.
//!
//! A 1.1 MB screenshot is ~1.5 MB of base64; tokenized as words it counts
//! a million tokens where the upstream counts under two thousand. A media
//! block is recognised by its shape, which also says whose prices apply:
//!
//! | API | block | estimate |
//! |---|---|---|
//! | Anthropic Messages | `image` (`source`: `base64`, `url`, `file`) | width × height / 750 after the API's resize ([`anthropic_image`]) |
//! | Anthropic Messages | `document` (`source`: `base64` PDF, `url`, `file`) | [`PDF_PAGE_TOKENS`] a page, pages counted from the PDF |
//! | OpenAI Chat | `image_url` (data URL or `http(s)` URL) | 85 + 170 a 512-px tile ([`openai_image`]) |
//! | OpenAI Chat | `input_audio` | [`AUDIO_TOKENS_PER_SECOND`] of its duration |
//! | OpenAI Chat | `file` (`file_data` PDF or `file_id`) | as a PDF |
//! | OpenAI Responses | `input_image` | as Chat's `image_url` |
//! | OpenAI Responses | `input_file` | as a PDF |
//!
//! An image's size is read from the few bytes of its header (PNG, JPEG,
//! GIF, WebP), decoded from the base64 where they lie; the payload is not
//! decoded. When the size is not in the request (a URL, a file id, another
//! format), the image is taken at the most the API charges for one
//! ([`ANTHROPIC_IMAGE_MAX`], [`OPENAI_IMAGE_MAX`]): an upper bound, so an
//! unknown image never makes a request look smaller than it is. A document
//! given as text (`source.type` `text` or `content`) is text and counted as
//! such.

use serde_json::{Map, Value};

/// Tokens of `block` when it is an image, document or audio block of one
/// of the APIs (its text members, a document's `title` and `context`, are
/// the caller's to count); `None` when it is not one.
pub(super) fn block_tokens(block: &Map<String, Value>) -> Option<u64> {
    if let Some(tokens) = gemini_part_tokens(block) {
        return Some(tokens);
    }
    match str_of(block.get("type"))? {
        // Anthropic Messages.
        "image" => {
            let source = block.get("source")?.as_object()?;
            Some(match str_of(source.get("type")) {
                Some("base64") => str_of(source.get("data"))
                    .and_then(|data| image_size(&Base64(data.as_bytes())))
                    .map_or(ANTHROPIC_IMAGE_MAX, |(w, h, _)| anthropic_image(w, h)),
                _ => ANTHROPIC_IMAGE_MAX,
            })
        }
        "document" => {
            let source = block.get("source")?.as_object()?;
            match str_of(source.get("type")) {
                // Plain text, or content blocks: text, counted as text.
                Some("text" | "content") => None,
                Some("base64") => Some(pdf_tokens(str_of(source.get("data")))),
                _ => Some(pdf_tokens(None)),
            }
        }
        // OpenAI Chat Completions.
        "image_url" => {
            let part = block.get("image_url")?;
            let (url, detail) = match part {
                Value::String(url) => (Some(url.as_str()), None),
                Value::Object(o) => (str_of(o.get("url")), str_of(o.get("detail"))),
                _ => return None,
            };
            Some(openai_image_url(url, detail))
        }
        "input_audio" => {
            let audio = block.get("input_audio")?.as_object()?;
            Some(audio_tokens(str_of(audio.get("data")).unwrap_or("")))
        }
        "file" => {
            let file = block.get("file")?.as_object()?;
            Some(pdf_tokens(
                str_of(file.get("file_data")).map(data_url_payload),
            ))
        }
        // OpenAI Responses.
        "input_image" => {
            if !block.contains_key("image_url") && !block.contains_key("file_id") {
                return None;
            }
            Some(openai_image_url(
                str_of(block.get("image_url")),
                str_of(block.get("detail")),
            ))
        }
        "input_file" => {
            if !["file_data", "file_id", "file_url"]
                .iter()
                .any(|k| block.contains_key(*k))
            {
                return None;
            }
            Some(pdf_tokens(
                str_of(block.get("file_data")).map(data_url_payload),
            ))
        }
        _ => None,
    }
}

/// Tokens a Gemini part costs when it carries media (`inlineData` with its
/// base64, `fileData` with a URI): an image 258 a 768-px tile (one tile
/// when both sides are at most 384 px; [`GEMINI_IMAGE_MAX`] when its size is
/// not in the request), a PDF 258 a page, audio 32 a second.
fn gemini_part_tokens(part: &Map<String, Value>) -> Option<u64> {
    let media = part
        .get("inlineData")
        .or_else(|| part.get("fileData"))?
        .as_object()?;
    let mime = str_of(media.get("mimeType")).unwrap_or("");
    let data = str_of(media.get("data"));
    Some(if mime.starts_with("image/") {
        data.and_then(|d| image_size(&Base64(d.as_bytes())))
            .map_or(GEMINI_IMAGE_MAX, |(w, h, _)| gemini_image(w, h))
    } else if mime.starts_with("audio/") {
        data.map_or(GEMINI_MEDIA_MAX, |d| {
            audio_tokens(d) / AUDIO_TOKENS_PER_SECOND * 32
        })
    } else if mime == "application/pdf" {
        let pages = data.and_then(|d| pdf_pages(&Base64(d.as_bytes())));
        pages.unwrap_or(PDF_MAX_PAGES).min(PDF_MAX_PAGES) * GEMINI_TILE_TOKENS
    } else {
        GEMINI_MEDIA_MAX
    })
}

/// Tokens of one Gemini image tile (and of one PDF page).
const GEMINI_TILE_TOKENS: u64 = 258;
/// What a Gemini image of unknown size is taken at: the most one costs at
/// high media resolution.
pub const GEMINI_IMAGE_MAX: u64 = 1_120;
/// What other Gemini media (video, an unknown type) is taken at: an upper
/// bound for a short clip, never the length of its base64.
const GEMINI_MEDIA_MAX: u64 = 16_000;

/// Tokens of a `w` × `h` image on Gemini: 258 when both sides are at most
/// 384 px, else 258 a 768 × 768 tile.
pub fn gemini_image(w: u32, h: u32) -> u64 {
    if w <= 384 && h <= 384 {
        return GEMINI_TILE_TOKENS;
    }
    let tiles = |side: u32| u64::from(side.div_ceil(768).max(1));
    tiles(w) * tiles(h) * GEMINI_TILE_TOKENS
}

/// What stands in for `block`, an image, document or audio block, when a
/// rung of the compaction cuts the content holding it: a line that says
/// what was there and what it cost (`[image omitted by compactor: 1568×1000
/// PNG, ~1600 tokens]`), so the model knows something it was shown is
/// gone. `None` when `block` is no such block.
pub fn omitted_marker(block: &Value) -> Option<String> {
    let map = block.as_object()?;
    let tokens = block_tokens(map)?;
    let gemini = map
        .get("inlineData")
        .or_else(|| map.get("fileData"))
        .and_then(|m| str_of(m.get("mimeType")));
    let kind = match (str_of(map.get("type")), gemini) {
        (Some("image" | "image_url" | "input_image"), _) => "image",
        (Some("input_audio"), _) => "audio",
        (_, Some(m)) if m.starts_with("image/") => "image",
        (_, Some(m)) if m.starts_with("audio/") => "audio",
        (_, Some(m)) if m.starts_with("video/") => "video",
        _ => "document",
    };
    let size = image_data(map)
        .and_then(|b64| image_size(&Base64(b64.as_bytes())))
        .map(|(w, h, format)| format!("{w}×{h} {}, ", format.name()))
        .unwrap_or_default();
    Some(format!(
        "[{kind} omitted by compactor: {size}~{tokens} tokens]"
    ))
}

/// The base64 of an image block, wherever its API puts it.
fn image_data(block: &Map<String, Value>) -> Option<&str> {
    if let Some(inline) = block.get("inlineData") {
        return str_of(inline.get("data"));
    }
    match str_of(block.get("type"))? {
        "image" => str_of(block.get("source")?.get("data")),
        "image_url" => match block.get("image_url")? {
            Value::String(url) => Some(url.as_str()),
            v => str_of(v.get("url")),
        }
        .map(data_url_payload),
        "input_image" => str_of(block.get("image_url")).map(data_url_payload),
        _ => None,
    }
}

fn str_of(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str)
}

/// Whether `s` names a block type [`block_tokens`] may recognise: an item
/// holding such a string is counted from its parsed form.
pub(super) fn is_block_type(s: &str) -> bool {
    matches!(
        s,
        "image" | "document" | "image_url" | "input_audio" | "file" | "input_image" | "input_file"
    ) || is_media_type(s)
}

/// A media type a Gemini part's `mimeType` may name.
fn is_media_type(s: &str) -> bool {
    ["image/", "audio/", "video/", "application/pdf"]
        .iter()
        .any(|p| s.starts_with(p))
        && s.len() < 64
}

/// The most an image costs on Anthropic Messages, taken when its size is
/// unknown: an image is scaled down until it is at most about 1,600 tokens
/// (1092 × 1092 is the largest square sent as it is: 1,590).
pub const ANTHROPIC_IMAGE_MAX: u64 = 1_600;
/// The long edge Anthropic scales an image down to.
const ANTHROPIC_LONG_EDGE: f64 = 1568.0;

/// Tokens of a `w` × `h` image on Anthropic Messages: (w × h) / 750 after
/// the API's resize (long edge at most 1568 px, then at most
/// [`ANTHROPIC_IMAGE_MAX`] tokens, about 1.15–1.2 megapixels).
pub fn anthropic_image(w: u32, h: u32) -> u64 {
    let (w, h) = (f64::from(w), f64::from(h));
    let scale = (ANTHROPIC_LONG_EDGE / w.max(h)).min(1.0);
    let pixels = w * scale * h * scale;
    ((pixels / 750.0).ceil() as u64).clamp(1, ANTHROPIC_IMAGE_MAX)
}

/// The most an image costs at OpenAI's high detail, taken when its size is
/// unknown: after the resize, at most 2 × 4 tiles of 512 px.
pub const OPENAI_IMAGE_MAX: u64 = 85 + 170 * 8;
/// An image at `detail: "low"`, whatever its size.
pub const OPENAI_IMAGE_LOW: u64 = 85;

/// Tokens of a `w` × `h` image on OpenAI's Chat Completions and Responses
/// at high (or `auto`) detail: scaled to fit in 2048 × 2048, then its short
/// side to 768 px (never up), then 85 + 170 for each 512-px tile. (The
/// GPT-4o family's pricing; models priced by 32-px patches count within
/// the same bound.)
pub fn openai_image(w: u32, h: u32) -> u64 {
    let (mut w, mut h) = (f64::from(w), f64::from(h));
    let fit = (2048.0 / w.max(h)).min(1.0);
    w *= fit;
    h *= fit;
    let short = (768.0 / w.min(h)).min(1.0);
    w *= short;
    h *= short;
    let tiles = (w / 512.0).ceil().max(1.0) * (h / 512.0).ceil().max(1.0);
    OPENAI_IMAGE_LOW + 170 * tiles as u64
}

/// An OpenAI image given by URL (a data URL or an address) and `detail`.
fn openai_image_url(url: Option<&str>, detail: Option<&str>) -> u64 {
    if detail == Some("low") {
        return OPENAI_IMAGE_LOW;
    }
    url.filter(|u| u.starts_with("data:"))
        .and_then(|u| image_size(&Base64(data_url_payload(u).as_bytes())))
        .map_or(OPENAI_IMAGE_MAX, |(w, h, _)| openai_image(w, h))
}

/// The base64 payload of a data URL (`data:image/png;base64,…`), or the
/// string itself when it is plain base64 (`file_data` may be either).
fn data_url_payload(s: &str) -> &str {
    match s.strip_prefix("data:") {
        Some(rest) => rest
            .split_once(";base64,")
            .map_or("", |(_, payload)| payload),
        None => s,
    }
}

/// Tokens a PDF page is taken at. Both APIs read a page as its text plus
/// an image of it; Anthropic documents 1,500 to 3,000 tokens a page by
/// its density, and this is the middle of that range.
pub const PDF_PAGE_TOKENS: u64 = 2_250;
/// The most pages a PDF is taken at (the APIs' own limit is 100).
const PDF_MAX_PAGES: u64 = 100;
/// When no page object is visible (they are compressed in object streams,
/// or the document is a file id or URL): a page per this many bytes, at
/// least one. A guess, stated: text pages are smaller, scanned pages larger.
const PDF_BYTES_PER_PAGE: u64 = 64 * 1024;

/// Tokens of a PDF given as base64 (`None`: by reference, its pages
/// unknown, taken at [`PDF_MAX_PAGES`] / 10 pages).
fn pdf_tokens(base64: Option<&str>) -> u64 {
    let pages = match base64 {
        Some(b64) => pdf_pages(&Base64(b64.as_bytes()))
            .unwrap_or_else(|| (Base64(b64.as_bytes()).decoded_len() / PDF_BYTES_PER_PAGE).max(1)),
        None => PDF_MAX_PAGES / 10,
    };
    pages.min(PDF_MAX_PAGES) * PDF_PAGE_TOKENS
}

/// The page objects (`/Type /Page`) of a PDF, when it shows any.
fn pdf_pages(pdf: &Base64) -> Option<u64> {
    const OVERLAP: usize = 32;
    let mut pages = 0;
    let mut buf = Vec::with_capacity(48 * 1024 + OVERLAP);
    let mut at = 0;
    let total = pdf.decoded_len() as usize;
    while at < total {
        // The chunk, after the last bytes of the one before: a marker cut
        // in two is found whole, and counted in the chunk it starts in.
        let keep = buf.len().min(OVERLAP);
        buf.drain(..buf.len() - keep);
        let end = (at + 48 * 1024).min(total);
        pdf.decode(at, end, &mut buf)?;
        let last = end == total;
        let counted_below = if last {
            buf.len()
        } else {
            buf.len() - OVERLAP.min(buf.len())
        };
        let mut k = 0;
        while let Some(found) = memchr::memmem::find(&buf[k..], b"/Type") {
            let start = k + found;
            if start >= counted_below {
                break;
            }
            pages += u64::from(page_marker(&buf[start + 5..]));
            k = start + 5;
        }
        at = end;
    }
    (pages > 0).then_some(pages)
}

/// Whether `rest`, after a `/Type`, names a page: `/Page` after optional
/// whitespace, not `/Pages` or another name that starts alike.
fn page_marker(rest: &[u8]) -> bool {
    let start = rest
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(rest.len());
    let rest = &rest[start..];
    rest.starts_with(b"/Page") && !rest.get(5).is_some_and(u8::is_ascii_alphanumeric)
}

/// Audio input, by its duration: OpenAI counts user audio at about a token
/// per 100 ms.
pub const AUDIO_TOKENS_PER_SECOND: u64 = 10;
/// The bytes a second of audio whose header gives no rate is taken at:
/// 128 kbit/s (MP3's usual rate).
const AUDIO_BYTES_PER_SECOND: u64 = 16_000;

/// Tokens of base64 audio: a WAV file's duration from its header's byte
/// rate, any other at [`AUDIO_BYTES_PER_SECOND`].
fn audio_tokens(b64: &str) -> u64 {
    let audio = Base64(b64.as_bytes());
    let len = audio.decoded_len();
    let rate = (audio.bytes(0, 4).as_deref() == Some(b"RIFF")
        && audio.bytes(8, 4).as_deref() == Some(b"WAVE"))
    .then(|| audio.bytes(28, 4))
    .flatten()
    .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
    .filter(|r| *r > 0)
    .unwrap_or(AUDIO_BYTES_PER_SECOND);
    (len.saturating_mul(AUDIO_TOKENS_PER_SECOND))
        .div_ceil(rate)
        .max(1)
}

/// An image format whose size [`image_size`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// PNG: the size in its IHDR chunk.
    Png,
    /// JPEG: the size in its frame header, after the segments before it.
    Jpeg,
    /// GIF: the logical screen's size.
    Gif,
    /// WebP: lossy, lossless or extended.
    WebP,
}

impl Format {
    /// Its usual name.
    pub fn name(self) -> &'static str {
        match self {
            Format::Png => "PNG",
            Format::Jpeg => "JPEG",
            Format::Gif => "GIF",
            Format::WebP => "WebP",
        }
    }
}

/// The width and height of an image, from its header: `None` for another
/// format, a header cut short, or a size of zero.
pub fn image_size(img: &(impl Bytes + ?Sized)) -> Option<(u32, u32, Format)> {
    let le16 = |b: Vec<u8>| u32::from(u16::from_le_bytes([b[0], b[1]]));
    let le24 = |b: Vec<u8>| u32::from_le_bytes([b[0], b[1], b[2], 0]);
    let head = img.bytes(0, 4)?;
    let (w, h, format) = match head.as_slice() {
        [0x89, b'P', b'N', b'G'] => {
            // The signature, then IHDR, the first chunk: width, height.
            if img.bytes(12, 4)?.as_slice() != b"IHDR" {
                return None;
            }
            let size = img.bytes(16, 8)?;
            let be32 =
                |i: usize| u32::from_be_bytes([size[i], size[i + 1], size[i + 2], size[i + 3]]);
            (be32(0), be32(4), Format::Png)
        }
        [b'G', b'I', b'F', b'8'] => (le16(img.bytes(6, 2)?), le16(img.bytes(8, 2)?), Format::Gif),
        [b'R', b'I', b'F', b'F'] if img.bytes(8, 4)?.as_slice() == b"WEBP" => {
            match img.bytes(12, 4)?.as_slice() {
                // Lossy: 14-bit sizes after the frame's start code.
                b"VP8 " => (
                    le16(img.bytes(26, 2)?) & 0x3fff,
                    le16(img.bytes(28, 2)?) & 0x3fff,
                    Format::WebP,
                ),
                // Lossless: two 14-bit sizes less one, after a signature byte.
                b"VP8L" => {
                    let b = img.bytes(21, 4)?;
                    let bits = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    (
                        1 + (bits & 0x3fff),
                        1 + ((bits >> 14) & 0x3fff),
                        Format::WebP,
                    )
                }
                // Extended: 24-bit sizes less one.
                b"VP8X" => (
                    1 + le24(img.bytes(24, 3)?),
                    1 + le24(img.bytes(27, 3)?),
                    Format::WebP,
                ),
                _ => return None,
            }
        }
        [0xff, 0xd8, ..] => {
            let (w, h) = jpeg_size(img)?;
            (w, h, Format::Jpeg)
        }
        _ => return None,
    };
    (w > 0 && h > 0).then_some((w, h, format))
}

/// Most JPEG segments walked to the frame header (EXIF, ICC profiles and
/// tables come first; each is skipped by its length, not read).
const JPEG_SEGMENTS: usize = 64;

/// A JPEG's size, from its frame header (SOF0 to SOF15 but DHT, JPG and
/// DAC), reached by skipping the segments before it.
fn jpeg_size(img: &(impl Bytes + ?Sized)) -> Option<(u32, u32)> {
    let be16 = |at: usize| -> Option<usize> {
        let b = img.bytes(at, 2)?;
        Some(usize::from(u16::from_be_bytes([b[0], b[1]])))
    };
    let mut at = 2;
    for _ in 0..JPEG_SEGMENTS {
        if img.bytes(at, 1)?[0] != 0xff {
            return None;
        }
        // Fill bytes before a marker.
        let mut marker = img.bytes(at + 1, 1)?[0];
        while marker == 0xff {
            at += 1;
            marker = img.bytes(at + 1, 1)?[0];
        }
        at += 2;
        match marker {
            // Markers without a segment.
            0x01 | 0xd0..=0xd7 => continue,
            0xc0..=0xcf if !matches!(marker, 0xc4 | 0xc8 | 0xcc) => {
                // Length, precision, height, width.
                let h = be16(at + 3)? as u32;
                let w = be16(at + 5)? as u32;
                return Some((w, h));
            }
            // Start of scan or end of image before any frame header.
            0xd9 | 0xda => return None,
            _ => at += be16(at)?,
        }
    }
    None
}

/// Bytes read by position, from wherever they are kept.
pub trait Bytes {
    /// `n` bytes from `at`, or `None` past the end (or where the encoding
    /// is broken).
    fn bytes(&self, at: usize, n: usize) -> Option<Vec<u8>>;
}

impl Bytes for [u8] {
    fn bytes(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        self.get(at..at.checked_add(n)?).map(<[u8]>::to_vec)
    }
}

/// Base64 text read as the bytes it encodes, each decoded from the four
/// characters that hold it: a header is read without decoding the rest.
/// The standard and URL-safe alphabets; no whitespace (the APIs take none).
pub struct Base64<'a>(pub &'a [u8]);

impl Base64<'_> {
    /// How many bytes the text encodes.
    pub fn decoded_len(&self) -> u64 {
        let s = self.0;
        let pad = s.iter().rev().take(2).filter(|c| **c == b'=').count();
        (s.len() as u64 * 3 / 4).saturating_sub(pad as u64)
    }

    /// The bytes group `g` (characters `4g..4g + 4`) holds, and how many.
    fn group(&self, g: usize) -> Option<([u8; 3], usize)> {
        let from = g.checked_mul(4)?;
        let group = self.0.get(from..(from + 4).min(self.0.len()))?;
        let mut bits = 0u32;
        let mut pad = 0;
        for (k, c) in group.iter().enumerate() {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' | b'-' => 62,
                b'/' | b'_' => 63,
                b'=' if k >= 2 => {
                    pad += 1;
                    0
                }
                _ => return None,
            };
            bits |= u32::from(v) << (18 - 6 * k);
        }
        // A group cut short, or padded, holds fewer bytes.
        let held = group.len().saturating_sub(1 + pad);
        Some(([(bits >> 16) as u8, (bits >> 8) as u8, bits as u8], held))
    }

    /// The byte at `i`.
    fn get(&self, i: usize) -> Option<u8> {
        let (bytes, held) = self.group(i / 3)?;
        (i % 3 < held).then(|| bytes[i % 3])
    }

    /// Appends bytes `at..end` (`at` a multiple of three) to `out`, each
    /// group of four characters decoded once.
    fn decode(&self, at: usize, end: usize, out: &mut Vec<u8>) -> Option<()> {
        debug_assert_eq!(at % 3, 0);
        for first in (at..end).step_by(3) {
            let (bytes, held) = self.group(first / 3)?;
            let n = (end - first).min(3);
            if n > held {
                return None;
            }
            out.extend_from_slice(&bytes[..n]);
        }
        Some(())
    }
}

/// Standard base64 with padding: what [`Base64`] reads (a request's
/// images are built with it in tests and demonstrations).
pub fn encode_base64(bytes: &[u8]) -> String {
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            out.push(if k <= chunk.len() {
                ABC[(n >> (18 - 6 * k)) as usize & 63] as char
            } else {
                '='
            });
        }
    }
    out
}

impl Bytes for Base64<'_> {
    fn bytes(&self, at: usize, n: usize) -> Option<Vec<u8>> {
        (at..at.checked_add(n)?).map(|i| self.get(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn b64(bytes: &[u8]) -> String {
        encode_base64(bytes)
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend(w.to_be_bytes());
        b.extend(h.to_be_bytes());
        b.extend([8, 6, 0, 0, 0, 0, 0, 0, 0]);
        b
    }

    fn jpeg(w: u16, h: u16) -> Vec<u8> {
        let mut b = vec![0xff, 0xd8];
        // An APP1 (EXIF) segment of 1,000 bytes, a fill byte, then SOF2.
        b.extend([0xff, 0xe1]);
        b.extend(1000u16.to_be_bytes());
        b.extend(vec![0x45; 998]);
        b.extend([0xff, 0xff, 0xc2, 0, 17, 8]);
        b.extend(h.to_be_bytes());
        b.extend(w.to_be_bytes());
        b.extend([3; 12]);
        b
    }

    type Size = (u32, u32, Format);

    #[test]
    fn sizes_are_read_from_the_headers_of_each_format() {
        let gif = [
            &b"GIF89a"[..],
            &640u16.to_le_bytes()[..],
            &480u16.to_le_bytes()[..],
            &[0; 4][..],
        ]
        .concat();
        let mut vp8 = b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0\0\0\0\x9d\x01\x2a".to_vec();
        vp8.extend((800u16 | 0x4000).to_le_bytes()); // scale bits above the size
        vp8.extend(600u16.to_le_bytes());
        let mut vp8l = b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0\x2f".to_vec();
        vp8l.extend(((1919u32) | (1079 << 14)).to_le_bytes());
        let mut vp8x = b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0\0\0\0\0".to_vec();
        vp8x.extend(&3999u32.to_le_bytes()[..3]);
        vp8x.extend(&2999u32.to_le_bytes()[..3]);
        let cases: [(Vec<u8>, Option<Size>); 8] = [
            (png(1568, 1000), Some((1568, 1000, Format::Png))),
            (jpeg(4032, 3024), Some((4032, 3024, Format::Jpeg))),
            (gif, Some((640, 480, Format::Gif))),
            (vp8, Some((800, 600, Format::WebP))),
            (vp8l, Some((1920, 1080, Format::WebP))),
            (vp8x, Some((4000, 3000, Format::WebP))),
            (png(0, 10), None),
            (b"%PDF-1.7\n".to_vec(), None),
        ];
        for (bytes, want) in cases {
            assert_eq!(image_size(bytes.as_slice()), want, "{:?}", &bytes[..8]);
            let text = b64(&bytes);
            assert_eq!(image_size(&Base64(text.as_bytes())), want, "{text}");
            // Cut short: no size, no panic.
            for cut in [0, 1, 5, 13, 22] {
                let short = &text[..cut.min(text.len())];
                let _ = image_size(&Base64(short.as_bytes()));
            }
        }
        // A JPEG whose frame header never comes, or whose segments are junk.
        assert_eq!(image_size(&[0xff, 0xd8, 0xff, 0xda, 0, 2][..]), None);
        assert_eq!(image_size(&[0xff, 0xd8, 0x00, 0x00][..]), None);
        // Not base64: no size.
        assert_eq!(image_size(&Base64(b"iVBO!!!!")), None);
    }

    #[test]
    fn base64_reads_any_byte_in_place() {
        let bytes: Vec<u8> = (0..=255u8).chain(0..7).collect();
        for len in 0..bytes.len() {
            let text = b64(&bytes[..len]);
            let b = Base64(text.as_bytes());
            assert_eq!(b.decoded_len(), len as u64);
            assert_eq!(b.bytes(0, len), Some(bytes[..len].to_vec()));
            assert_eq!(b.bytes(len, 1), None, "past the end of {len}");
        }
        // URL-safe alphabet.
        assert_eq!(Base64(b"-_8=").bytes(0, 2), Some(vec![0xfb, 0xff]));
    }

    #[test]
    fn anthropic_charges_pixels_over_750_after_its_resize() {
        assert_eq!(anthropic_image(200, 200), 54);
        assert_eq!(anthropic_image(1000, 1000), 1334);
        assert_eq!(anthropic_image(1092, 1092), 1590);
        // Long edge to 1568, then the cap.
        assert_eq!(anthropic_image(3136, 400), 1568 * 200 / 750 + 1);
        assert_eq!(anthropic_image(1568, 1000), ANTHROPIC_IMAGE_MAX);
        assert_eq!(anthropic_image(3840, 2160), ANTHROPIC_IMAGE_MAX);
        assert_eq!(anthropic_image(1, 1), 1);
    }

    #[test]
    fn openai_charges_tiles_after_its_resize() {
        // OpenAI's own examples: 1024 × 1024 is 765; 2048 × 4096 is 1105.
        assert_eq!(openai_image(1024, 1024), 765);
        assert_eq!(openai_image(2048, 4096), 1105);
        assert_eq!(openai_image(512, 512), 255);
        assert_eq!(openai_image(100, 100), 255);
        // 1920 × 1080: short side to 768, 1366 × 768, 3 × 2 tiles.
        assert_eq!(openai_image(1920, 1080), 85 + 170 * 6);
        // No size above the bound an unknown image is taken at.
        for (w, h) in [(768, 2048), (800, 20_000), (1, 1_000_000), (30_000, 30_000)] {
            assert!(openai_image(w, h) <= OPENAI_IMAGE_MAX, "{w}×{h}");
        }
        assert_eq!(openai_image(768, 2048), OPENAI_IMAGE_MAX);
    }

    #[test]
    fn each_apis_blocks_are_priced_by_that_api() {
        let png = b64(&png(1024, 1024));
        let block = |v: Value| block_tokens(v.as_object().unwrap());
        let data_url = format!("data:image/png;base64,{png}");
        assert_eq!(
            block(
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}})
            ),
            Some(1399)
        );
        assert_eq!(
            block(json!({"type": "image", "source": {"type": "url", "url": "https://x/y.png"}})),
            Some(ANTHROPIC_IMAGE_MAX)
        );
        assert_eq!(
            block(json!({"type": "image_url", "image_url": {"url": data_url}})),
            Some(765)
        );
        assert_eq!(
            block(json!({"type": "image_url", "image_url": {"url": data_url, "detail": "low"}})),
            Some(85)
        );
        assert_eq!(
            block(json!({"type": "image_url", "image_url": {"url": "https://x/y.png"}})),
            Some(OPENAI_IMAGE_MAX)
        );
        assert_eq!(
            block(json!({"type": "input_image", "image_url": data_url, "detail": "auto"})),
            Some(765)
        );
        assert_eq!(
            block(json!({"type": "input_image", "file_id": "file-1"})),
            Some(OPENAI_IMAGE_MAX)
        );
        // A type name alone is no block.
        assert_eq!(block(json!({"type": "image"})), None);
        assert_eq!(block(json!({"type": "file", "name": "x"})), None);
        assert_eq!(block(json!({"type": "text", "text": "image"})), None);
        // A document given as text is text.
        assert_eq!(
            block(
                json!({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}})
            ),
            None
        );
    }

    #[test]
    fn a_cut_block_leaves_a_marker_saying_what_it_was() {
        let png = b64(&png(1568, 1000));
        let marker = |v: Value| omitted_marker(&v);
        assert_eq!(
            marker(
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}})
            ),
            Some("[image omitted by compactor: 1568×1000 PNG, ~1600 tokens]".into())
        );
        assert_eq!(
            marker(
                json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}})
            ),
            Some("[image omitted by compactor: 1568×1000 PNG, ~1105 tokens]".into())
        );
        assert_eq!(
            marker(json!({"type": "input_image", "image_url": "https://x/y.png"})),
            Some("[image omitted by compactor: ~1445 tokens]".into())
        );
        assert_eq!(
            marker(json!({"type": "input_file", "file_id": "file-1"})),
            Some("[document omitted by compactor: ~22500 tokens]".into())
        );
        assert_eq!(marker(json!({"type": "text", "text": "hi"})), None);
    }

    #[test]
    fn a_pdf_is_priced_by_its_pages() {
        let mut pdf = b"%PDF-1.4\n1 0 obj << /Type /Pages /Count 3 >> endobj\n".to_vec();
        for i in 0..3 {
            pdf.extend(
                format!("{} 0 obj << /Type\n/Page /Parent 1 0 R >> endobj\n", i + 2).bytes(),
            );
            // Enough between pages for the scan's chunks to cut markers.
            pdf.extend(vec![b'x'; 30_000 + i * 7]);
        }
        pdf.extend(b"9 0 obj << /Type/Page>> endobj\n<< /Type /PageLabel >>");
        let text = b64(&pdf);
        assert_eq!(pdf_pages(&Base64(text.as_bytes())), Some(4));
        let doc = json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": text}});
        assert_eq!(
            block_tokens(doc.as_object().unwrap()),
            Some(4 * PDF_PAGE_TOKENS)
        );
        let file = json!({"type": "input_file", "filename": "a.pdf", "file_data": format!("data:application/pdf;base64,{text}")});
        assert_eq!(
            block_tokens(file.as_object().unwrap()),
            Some(4 * PDF_PAGE_TOKENS)
        );
        let chat = json!({"type": "file", "file": {"file_data": text}});
        assert_eq!(
            block_tokens(chat.as_object().unwrap()),
            Some(4 * PDF_PAGE_TOKENS)
        );
        // No page objects in sight (compressed): by its size.
        let packed = b64(&vec![7u8; 200 * 1024]);
        assert_eq!(pdf_tokens(Some(&packed)), 3 * PDF_PAGE_TOKENS);
        assert_eq!(pdf_tokens(None), 10 * PDF_PAGE_TOKENS);
    }

    #[test]
    fn audio_is_priced_by_its_duration() {
        // A WAV header at 48,000 bytes a second, then two seconds.
        let mut wav = b"RIFF\0\0\0\0WAVEfmt \x10\0\0\0\x01\0\x01\0\xc0\x5d\0\0".to_vec();
        wav.extend(48_000u32.to_le_bytes());
        wav.extend(vec![0; 96_000 - wav.len()]);
        let block =
            json!({"type": "input_audio", "input_audio": {"data": b64(&wav), "format": "wav"}});
        assert_eq!(block_tokens(block.as_object().unwrap()), Some(20));
        // Another format: at 16,000 bytes a second.
        let mp3 = b64(&vec![0x55; 32_000]);
        assert_eq!(audio_tokens(&mp3), 20);
    }
}
