//! Streaming detokenization: token pieces are bytes, and one character may be split across
//! several tokens (byte-level BPE, `<0xXX>` byte fallback). [`StreamDecoder`] buffers the bytes
//! of an unfinished UTF-8 sequence and hands out text only once it is complete.

use super::{TokenId, Tokenizer};

/// Accumulates token bytes and yields valid UTF-8 text as it completes.
///
/// ```ignore
/// let mut stream = StreamDecoder::new();
/// for id in generated {
///     print!("{}", stream.push(&tokenizer, id));
/// }
/// print!("{}", stream.finish());
/// ```
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder that renders control tokens as their text (like [`Tokenizer::decode`]).
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// A decoder that drops control and unknown tokens (like [`Tokenizer::decode_skip_special`]).
    pub fn skipping_special() -> StreamDecoder {
        StreamDecoder {
            pending: Vec::new(),
            skip_special: true,
        }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: TokenId) -> String {
        if self.skip_special && tokenizer.is_control(id) {
            return String::new();
        }
        self.push_bytes(tokenizer.token_to_piece(id))
    }

    /// Adds raw piece bytes; returns the text they complete (possibly empty). Invalid bytes
    /// become U+FFFD; an unfinished sequence at the end waits for the next push.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut text = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(valid) => {
                    text.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid_len = error.valid_up_to();
                    let valid = &self.pending[consumed..consumed + valid_len];
                    // `valid_up_to` bytes are UTF-8 by definition.
                    text.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    consumed += valid_len;
                    match error.error_len() {
                        Some(invalid_len) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed += invalid_len;
                        }
                        // An incomplete sequence at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        text
    }

    /// Bytes of an unfinished character still waiting for the rest.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is still pending, with U+FFFD for an unfinished character.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_byte_character_split_across_pushes() {
        let mut stream = StreamDecoder::new();
        let euro = "€".as_bytes(); // e2 82 ac
        assert_eq!(stream.push_bytes(&euro[..1]), "");
        assert_eq!(stream.push_bytes(&euro[1..2]), "");
        assert_eq!(stream.push_bytes(&[euro[2], b'!']), "€!");
        assert!(stream.pending_bytes().is_empty());
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut stream = StreamDecoder::new();
        assert_eq!(stream.push_bytes(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(stream.push_bytes(&[0xE2, 0x82]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
    }
}
