//! Unicode helpers for pre-tokenization, mirroring llama.cpp's `unicode.cpp` data model.
//!
//! llama.cpp classifies each codepoint into one coarse category (letter, number, punctuation, …)
//! plus a whitespace flag, and its hand-written splitters and its "collapsed" regex trick work on
//! those flags rather than on full Unicode properties. We derive the same flags from the Unicode
//! general category (`unicode-general-category`, Unicode 16) and the `White_Space` property
//! (`char::is_whitespace`, which is exactly llama.cpp's whitespace list).
//!
//! Also here: GPT-2's byte-level alphabet (each byte ↔ one printable codepoint).

use unicode_general_category::{GeneralCategory, get_general_category};

/// Coarse codepoint class, one per codepoint (llama.cpp `unicode_cpt_flags` categories).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CodepointClass {
    /// Unassigned (`Cn`).
    Undefined,
    Number,
    Letter,
    Separator,
    AccentMark,
    Punctuation,
    Symbol,
    /// `Cc`, `Cf`, `Co`, `Cs`.
    Control,
}

/// The flags llama.cpp's splitters look at. `Flags::OUT_OF_RANGE` (all false, `is_some` false)
/// stands for "past the end of the fragment".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flags {
    class: Option<CodepointClass>,
    pub is_whitespace: bool,
}

impl Flags {
    pub const OUT_OF_RANGE: Flags = Flags {
        class: None,
        is_whitespace: false,
    };

    pub fn of(c: char) -> Flags {
        Flags {
            class: Some(class_of(c)),
            is_whitespace: c.is_whitespace(),
        }
    }

    /// True for any real codepoint (llama.cpp: `flags.as_uint() != 0`).
    pub fn is_some(self) -> bool {
        self.class.is_some()
    }

    pub fn class(self) -> Option<CodepointClass> {
        self.class
    }

    pub fn is_letter(self) -> bool {
        self.class == Some(CodepointClass::Letter)
    }

    pub fn is_number(self) -> bool {
        self.class == Some(CodepointClass::Number)
    }

    pub fn is_accent_mark(self) -> bool {
        self.class == Some(CodepointClass::AccentMark)
    }
}

pub(crate) fn class_of(c: char) -> CodepointClass {
    use GeneralCategory as G;
    match get_general_category(c) {
        G::Unassigned => CodepointClass::Undefined,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => CodepointClass::Number,
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => CodepointClass::Letter,
        G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => CodepointClass::Separator,
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark => CodepointClass::AccentMark,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation => CodepointClass::Punctuation,
        G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol => {
            CodepointClass::Symbol
        }
        // Control, Format, PrivateUse, Surrogate and any category added later.
        _ => CodepointClass::Control,
    }
}

/// GPT-2's byte-level alphabet: the printable Latin-1 bytes map to themselves, the other 68
/// bytes to U+0100 onwards, in byte order.
pub(crate) struct ByteAlphabet {
    byte_to_char: [char; 256],
    /// Inverse of `byte_to_char`, indexed by codepoint (all alphabet codepoints are < U+0144).
    char_to_byte: [Option<u8>; ALPHABET_END],
}

/// One past the largest codepoint of the byte alphabet (0x100 + 68 remapped bytes).
const ALPHABET_END: usize = 0x144;

impl ByteAlphabet {
    pub fn new() -> ByteAlphabet {
        let mut byte_to_char = ['\0'; 256];
        let mut char_to_byte = [None; ALPHABET_END];
        let mut next_extra = 0x100usize;
        for byte in 0..=255u8 {
            let printable = matches!(byte, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            let codepoint = if printable {
                usize::from(byte)
            } else {
                next_extra += 1;
                next_extra - 1
            };
            char_to_byte[codepoint] = Some(byte);
            // Every codepoint here is below U+0144, hence a valid scalar value.
            byte_to_char[usize::from(byte)] = u32::try_from(codepoint)
                .ok()
                .and_then(char::from_u32)
                .unwrap_or('\u{FFFD}');
        }
        ByteAlphabet {
            byte_to_char,
            char_to_byte,
        }
    }

    pub fn char_of(&self, byte: u8) -> char {
        self.byte_to_char[usize::from(byte)]
    }

    /// The byte a codepoint of the alphabet stands for.
    pub fn byte_of(&self, c: char) -> Option<u8> {
        let index = usize::try_from(u32::from(c)).ok()?;
        self.char_to_byte.get(index).copied().flatten()
    }

    /// `text`'s UTF-8 bytes, each replaced by its alphabet codepoint.
    pub fn encode(&self, text: &str, out: &mut String) {
        out.clear();
        out.extend(text.bytes().map(|b| self.char_of(b)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_round_trips_every_byte() {
        let alphabet = ByteAlphabet::new();
        for byte in 0..=255u8 {
            assert_eq!(alphabet.byte_of(alphabet.char_of(byte)), Some(byte));
        }
        assert_eq!(alphabet.char_of(b' '), 'Ġ');
        assert_eq!(alphabet.char_of(b'\n'), 'Ċ');
    }

    #[test]
    fn classes_match_llama_cpp_flags() {
        assert_eq!(class_of('a'), CodepointClass::Letter);
        assert_eq!(class_of('7'), CodepointClass::Number);
        assert_eq!(class_of('\u{0301}'), CodepointClass::AccentMark);
        assert_eq!(class_of('$'), CodepointClass::Symbol);
        assert_eq!(class_of('!'), CodepointClass::Punctuation);
        assert_eq!(class_of(' '), CodepointClass::Separator);
        assert_eq!(class_of('\n'), CodepointClass::Control);
        assert_eq!(class_of('\u{0378}'), CodepointClass::Undefined);
        assert!(Flags::of('\u{3000}').is_whitespace);
        assert!(!Flags::OUT_OF_RANGE.is_some());
    }
}
