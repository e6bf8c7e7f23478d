//! Streaming detokenization as mlx-lm does it (BPE, SentencePiece and naive strategies), so the
//! text printed while generating matches what `mlx_lm.generate` prints.

use std::sync::Arc;

use serde_json::Value as Json;

use super::{Backend, Tokenizer, TokenizerError};

/// Which streaming strategy mlx-lm's `load` picks, from the raw `decoder` of tokenizer.json.
#[derive(Clone)]
pub(super) enum DetokenizerKind {
    /// ByteLevel decoders: `BPEStreamingDetokenizer`, over the token strings.
    Bpe(Arc<Vec<String>>),
    /// SentencePiece-style decoders: `SPMStreamingDetokenizer`, over token bytes.
    Spm {
        pieces: Arc<Vec<Vec<u8>>>,
        trim_space: bool,
    },
    /// Anything else: `NaiveStreamingDetokenizer`, which re-decodes the current line.
    Naive { trim_trailing_space: bool },
}

impl DetokenizerKind {
    pub(super) fn for_decoder(
        decoder: &Json,
        backend: &Backend,
    ) -> Result<DetokenizerKind, TokenizerError> {
        let spm_steps = serde_json::json!([
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]);
        let mut spm_with_strip = spm_steps.clone();
        if let Json::Array(steps) = &mut spm_with_strip {
            steps.push(serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let is_sequence_of =
            |steps: &Json| *decoder == serde_json::json!({"type": "Sequence", "decoders": steps});
        let n = backend.hf.get_vocab_size(true);
        let token = |id: usize| {
            u32::try_from(id)
                .ok()
                .and_then(|id| backend.hf.id_to_token(id))
        };
        if is_sequence_of(&spm_with_strip) || is_sequence_of(&spm_steps) {
            let pieces = (0..n)
                .map(|id| token(id).map(|t| spm_piece_bytes(&t)).unwrap_or_default())
                .collect();
            return Ok(DetokenizerKind::Spm {
                pieces: Arc::new(pieces),
                trim_space: is_sequence_of(&spm_with_strip),
            });
        }
        if decoder.get("type").and_then(Json::as_str) == Some("ByteLevel") {
            let tokens = (0..n)
                .map(|id| token(id).unwrap_or_else(|| BPE_UNKNOWN_TOKEN.to_string()))
                .collect();
            return Ok(DetokenizerKind::Bpe(Arc::new(tokens)));
        }
        // mlx-lm probes whether decode drops the space in "a ,b" to know if a trailing space
        // may still be cleaned away, and then holds trailing spaces back.
        let probe = backend
            .hf
            .encode("a ,b", false)
            .map_err(TokenizerError::Encode)?;
        let decoded = backend.decode(probe.get_ids())?;
        Ok(DetokenizerKind::Naive {
            trim_trailing_space: !decoded.contains(" ,"),
        })
    }
}

/// mlx-lm's SPM token map: `<0xNN>` byte tokens carry their byte, others their UTF-8.
fn spm_piece_bytes(token: &str) -> Vec<u8> {
    token
        .strip_prefix("<0x")
        .and_then(|rest| rest.get(..2))
        .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        .map_or_else(|| token.as_bytes().to_vec(), |b| vec![b])
}

/// mlx-lm substitutes "!" for ids its token map lacks (a padded model vocabulary can sample
/// ids the tokenizer does not have).
const BPE_UNKNOWN_TOKEN: &str = "!";

/// GPT-2's byte-to-character table, inverted: the byte a ByteLevel character stands for.
/// Printable Latin-1 bytes stand for themselves; the 68 others map, in order, to U+0100..U+0143.
fn byte_level_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    let byte = match code {
        0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => code,
        0x100..=0x120 => code - 0x100,        // 0x00..=0x20
        0x121..=0x142 => code - 0x121 + 0x7f, // 0x7f..=0xa0
        0x143 => 0xad,
        _ => return None,
    };
    u8::try_from(byte).ok()
}

/// The bytes of ByteLevel token text as mlx-lm's `_decode_bytes` computes them while streaming.
/// Quirk kept for parity: byte 0 (U+0100) is falsy in its `if res:` test, so that character is
/// emitted as its own UTF-8 ("Ā") instead of a NUL byte; characters outside the table (as in
/// added tokens) also pass through as UTF-8.
fn bpe_stream_bytes(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_level_byte(c) {
            Some(b) if b != 0 => bytes.push(b),
            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// The bytes mlx-lm's `finalize` computes: the exact table (so U+0100 is a NUL byte here). Python
/// raises on characters outside the table; they pass through as UTF-8 instead.
fn bpe_final_bytes(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_level_byte(c) {
            Some(b) => bytes.push(b),
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// Streams generated text the way mlx-lm's detokenizers do, so what the engine prints while
/// generating matches what `mlx_lm.generate` prints.
///
/// Like mlx-lm, the BPE and SPM strategies drop one leading space of the whole output, and text
/// is only released once it does not end in an incomplete UTF-8 character.
pub struct StreamingDetokenizer {
    state: StreamState,
    text: String,
    /// Bytes of `text` already handed out by `take_segment`.
    offset: usize,
}

enum StreamState {
    Bpe {
        tokens: Arc<Vec<String>>,
        unflushed: String,
    },
    Spm {
        pieces: Arc<Vec<Vec<u8>>>,
        trim_space: bool,
        unflushed: Vec<u8>,
    },
    Naive {
        backend: Arc<Backend>,
        trim_trailing_space: bool,
        /// Bytes of `text` that are final (everything up to the last completed line).
        committed: usize,
        /// Tokens of the current, still revisable line.
        current: Vec<u32>,
    },
}

const REPLACEMENT: char = '\u{fffd}';

/// mlx-lm's `_maybe_trim_space`: the very first text of an output loses one leading space.
fn trim_first_space(text: &str, output_so_far: &str) -> String {
    match text.strip_prefix(' ') {
        Some(rest) if output_so_far.is_empty() => rest.to_string(),
        _ => text.to_string(),
    }
}

impl StreamingDetokenizer {
    /// Feed every generated token except a stopping eos, which mlx-lm never adds.
    pub fn add_token(&mut self, id: u32) {
        match &mut self.state {
            StreamState::Bpe { tokens, unflushed } => {
                let token = tokens
                    .get(id as usize)
                    .map_or(BPE_UNKNOWN_TOKEN, String::as_str);
                unflushed.push_str(token);
                let text = String::from_utf8_lossy(&bpe_stream_bytes(unflushed)).into_owned();
                // Wait for incomplete characters, and keep a lone space token until the next
                // token shows whether it starts the output (and is trimmed).
                let lone_space = token == "\u{120}";
                if !text.ends_with(REPLACEMENT) && !lone_space {
                    let text = trim_first_space(&text, &self.text);
                    self.text.push_str(&text);
                    unflushed.clear();
                }
            }
            StreamState::Spm {
                pieces, unflushed, ..
            } => {
                if let Some(piece) = pieces.get(id as usize) {
                    unflushed.extend_from_slice(piece);
                }
                self.flush_spm(false);
            }
            StreamState::Naive {
                backend,
                trim_trailing_space,
                committed,
                current,
            } => {
                current.push(id);
                // A decoder error leaves the line as it was; the next token retries it.
                let Ok(mut line) = backend.decode(current) else {
                    return;
                };
                if line.ends_with(REPLACEMENT) {
                    line.truncate(line.trim_end_matches(REPLACEMENT).len());
                } else if *trim_trailing_space && line.ends_with(' ') {
                    line.pop();
                }
                self.text.truncate(*committed);
                self.text.push_str(&line);
                if line.ends_with('\n') {
                    *committed = self.text.len();
                    current.clear();
                }
            }
        }
    }

    fn flush_spm(&mut self, force: bool) {
        let StreamState::Spm {
            trim_space,
            unflushed,
            ..
        } = &mut self.state
        else {
            return;
        };
        let spaced = replace_bytes(unflushed, "\u{2581}".as_bytes(), b" ");
        let text = String::from_utf8_lossy(&spaced).into_owned();
        if !force && text.ends_with(REPLACEMENT) {
            return;
        }
        let text = if *trim_space {
            trim_first_space(&text, &self.text)
        } else {
            text
        };
        self.text.push_str(&text);
        unflushed.clear();
    }

    /// Text that became final since the last call; never ends inside a UTF-8 character.
    pub fn take_segment(&mut self) -> String {
        // Only the naive strategy revises text; if it shrank, resume from the new end.
        let mut start = self.offset.min(self.text.len());
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let segment = self.text[start..].to_string();
        self.offset = self.text.len();
        segment
    }

    /// Flushes whatever is held back (an incomplete trailing character becomes U+FFFD, as
    /// Python's errors="replace" decoding does) and returns the rest of the text.
    pub fn finalize(&mut self) -> String {
        match &mut self.state {
            StreamState::Bpe { unflushed, .. } => {
                let text = String::from_utf8_lossy(&bpe_final_bytes(unflushed)).into_owned();
                unflushed.clear();
                let text = trim_first_space(&text, &self.text);
                self.text.push_str(&text);
            }
            StreamState::Spm { .. } => self.flush_spm(true),
            StreamState::Naive {
                backend,
                committed,
                current,
                ..
            } => {
                if let Ok(line) = backend.decode(current) {
                    self.text.truncate(*committed);
                    self.text.push_str(&line);
                }
                *committed = self.text.len();
                current.clear();
            }
        }
        self.take_segment()
    }

    /// All text so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

fn replace_bytes(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}

impl Tokenizer {
    /// A fresh streaming detokenizer with the strategy mlx-lm picks for this tokenizer.json.
    pub fn detokenizer(&self) -> StreamingDetokenizer {
        StreamingDetokenizer {
            state: match &self.detokenizer {
                DetokenizerKind::Bpe(tokens) => StreamState::Bpe {
                    tokens: Arc::clone(tokens),
                    unflushed: String::new(),
                },
                DetokenizerKind::Spm { pieces, trim_space } => StreamState::Spm {
                    pieces: Arc::clone(pieces),
                    trim_space: *trim_space,
                    unflushed: Vec::new(),
                },
                DetokenizerKind::Naive {
                    trim_trailing_space,
                } => StreamState::Naive {
                    backend: Arc::clone(&self.backend),
                    trim_trailing_space: *trim_trailing_space,
                    committed: 0,
                    current: Vec::new(),
                },
            },
            text: String::new(),
            offset: 0,
        }
    }
}
