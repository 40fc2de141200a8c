//! The pre-tokenizer of each `tokenizer.ggml.pre` name, as llama.cpp defines them
//! (`llama-vocab.cpp`: the name → pre-type table and the regex list of each pre-type).
//!
//! Non-ASCII characters in the regexes are written as `\u{…}` escapes: several are
//! compatibility characters (U+1FD3, U+2126, U+212A…) that text tools silently normalize.
//!
//! A preset is an ordered list of split rules: each rule re-splits every piece the previous rules
//! produced, keeping both what it matched and what lies between matches. Four regexes that
//! llama.cpp replaces with hand-written splitters are named rules here ([`SplitRule::Gpt2`],
//! [`SplitRule::Llama3`], [`SplitRule::Newlines`]); every other regex is run as a regex.

/// One step of pre-tokenization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SplitRule {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (GPT-2).
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` (llama3: 3 digits; qwen2: 1 digit;
    /// qwen35 also treats accent marks like letters).
    Llama3 {
        max_digits: usize,
        marks_join_letters: bool,
    },
    /// `[^\n]+|[\n]+`.
    Newlines,
    /// Any other regex (llama.cpp's `std::regex` path).
    Regex(&'static str),
}

/// Everything a `tokenizer.ggml.pre` name decides.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Preset {
    pub rules: &'static [SplitRule],
    /// A pre-split word found whole in the vocabulary is emitted as one token, skipping merges.
    pub ignore_merges: bool,
    /// Default for `add_bos` when the metadata does not say.
    pub add_bos: bool,
    /// GPT-2 byte-level alphabet (false: merges run on raw UTF-8, bytes fall back to `<0xXX>`).
    pub byte_encode: bool,
    /// Spaces become `▁` before splitting (SentencePiece-style BPE).
    pub escape_whitespace: bool,
    /// The default BOS id is dropped (a metadata BOS id still applies).
    pub no_default_bos: bool,
}

const BASE: Preset = Preset {
    rules: &[],
    ignore_merges: false,
    add_bos: false,
    byte_encode: true,
    escape_whitespace: false,
    no_default_bos: false,
};

const GPT2: SplitRule = SplitRule::Gpt2;
const LLAMA3: SplitRule = SplitRule::Llama3 {
    max_digits: 3,
    marks_join_letters: false,
};
const QWEN2: SplitRule = SplitRule::Llama3 {
    max_digits: 1,
    marks_join_letters: false,
};
const QWEN35: SplitRule = SplitRule::Llama3 {
    max_digits: 1,
    marks_join_letters: true,
};

const ONE_DIGIT: SplitRule = SplitRule::Regex(r"\p{N}");
const ONE_TO_THREE_DIGITS: SplitRule = SplitRule::Regex(r"\p{N}{1,3}");
const CJK_KANA: SplitRule =
    SplitRule::Regex("[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+");
const FINNISH_WORDS: SplitRule =
    SplitRule::Regex(" ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+");

const RULES_LLAMA3: &[SplitRule] = &[LLAMA3];
const RULES_QWEN2: &[SplitRule] = &[QWEN2];
const RULES_QWEN35: &[SplitRule] = &[QWEN35];
const RULES_GPT2: &[SplitRule] = &[GPT2];
const RULES_STARCODER: &[SplitRule] = &[ONE_DIGIT, GPT2];
const RULES_NEWLINES: &[SplitRule] = &[SplitRule::Newlines];
const RULES_DEFAULT: &[SplitRule] = &[
    SplitRule::Regex(r"[\p{P}\$\+<=>\^~\|]+"),
    GPT2,
    SplitRule::Regex(r"\p{N}+"),
    SplitRule::Regex("[0-9][0-9][0-9]"),
];
const RULES_JAIS2: &[SplitRule] = &[SplitRule::Regex(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
)];
const RULES_DEEPSEEK_LLM: &[SplitRule] = &[
    SplitRule::Regex("[\r\n]"),
    SplitRule::Regex(
        "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    ),
    SplitRule::Regex(
        "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
    ),
    SplitRule::Regex(r"\s+$"),
    SplitRule::Regex("[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+"),
    SplitRule::Regex(r"\p{N}+"),
];
const RULES_DEEPSEEK3: &[SplitRule] = &[
    ONE_TO_THREE_DIGITS,
    CJK_KANA,
    SplitRule::Regex(
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
    ),
];
const RULES_SPARK2_5: &[SplitRule] = &[
    ONE_TO_THREE_DIGITS,
    CJK_KANA,
    SplitRule::Regex(
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##,
    ),
    ONE_DIGIT,
];
const RULES_YOUTU: &[SplitRule] = &[
    SplitRule::Regex(
        "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    ),
    SplitRule::Regex(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];
const RULES_DEEPSEEK_CODER: &[SplitRule] = &[
    SplitRule::Regex("[\r\n]"),
    SplitRule::Regex(r"\s?\p{L}+"),
    SplitRule::Regex(r"\s?\p{P}+"),
    SplitRule::Regex("[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+"),
    ONE_DIGIT,
];
const RULES_FALCON: &[SplitRule] = &[
    SplitRule::Regex(r"[\p{P}\$\+<=>\^~\|`]+"),
    GPT2,
    SplitRule::Regex("[0-9][0-9][0-9]"),
];
const RULES_FINNISH: &[SplitRule] = &[FINNISH_WORDS];
const RULES_VIKING: &[SplitRule] = &[FINNISH_WORDS, ONE_DIGIT];
const RULES_TEKKEN: &[SplitRule] = &[SplitRule::Regex(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)];
const RULES_CHAMELEON: &[SplitRule] = &[
    SplitRule::Regex("<sentinel:[0-9]+>"),
    SplitRule::Regex("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
    SplitRule::Regex(r"([\t\n]|    |  )"),
    ONE_DIGIT,
    SplitRule::Regex(r"[\p{P}!-/:-@\[-`{-~]"),
    GPT2,
];
const RULES_GPT4O: &[SplitRule] = &[SplitRule::Regex(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)];
const RULES_GRANITE_EMB_MULTI: &[SplitRule] = &[SplitRule::Regex(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)];
const RULES_SUPERBPE: &[SplitRule] = &[
    SplitRule::Regex(r"\p{N}+"),
    SplitRule::Regex(r"(?=(\d{3})+(?!\d))"),
];
const RULES_BAILINGMOE: &[SplitRule] = &[SplitRule::Regex(
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
)];
const RULES_SEED_CODER: &[SplitRule] = &[SplitRule::Regex(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
)];
const RULES_UFAKZEKA: &[SplitRule] = &[SplitRule::Regex(
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)];
const RULES_LAGUNA: &[SplitRule] = &[SplitRule::Newlines, QWEN2];
const RULES_EXAONE_MOE: &[SplitRule] = &[SplitRule::Regex(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
)];
const RULES_MINICPM5: &[SplitRule] = &[
    ONE_TO_THREE_DIGITS,
    SplitRule::Regex(
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
];

/// Pre names llama.cpp knows but implements with custom code we do not have.
pub(crate) const UNSUPPORTED_PRE_NAMES: &[&str] =
    &["kimi-k2", "afmoe", "tiny_aya", "cohere2moe", "whitespace"];

/// The preset for a `tokenizer.ggml.pre` value, or `None` for a name we do not know.
pub(crate) fn preset(name: &str) -> Option<Preset> {
    let rules = |rules| Preset { rules, ..BASE };
    let p = match name {
        "default" => rules(RULES_DEFAULT),
        "minicpm5" => Preset {
            ignore_merges: true,
            ..rules(RULES_MINICPM5)
        },
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => Preset {
            ignore_merges: true,
            add_bos: true,
            ..rules(RULES_LLAMA3)
        },
        "deepseek-llm" => rules(RULES_DEEPSEEK_LLM),
        "deepseek-coder" => rules(RULES_DEEPSEEK_CODER),
        "deepseek-v3" | "hunyuan-dense" | "hy_v4" | "joyai-llm" => rules(RULES_DEEPSEEK3),
        "spark2_5" => rules(RULES_SPARK2_5),
        "youtu" => Preset {
            ignore_merges: true,
            ..rules(RULES_YOUTU)
        },
        "falcon" => rules(RULES_FALCON),
        "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" | "gpt-2"
        | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            rules(RULES_GPT2)
        }
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => rules(RULES_STARCODER),
        "jais-2" => rules(RULES_JAIS2),
        "gemma4" | "granite-embed-multi-311m" | "sarvam-moe" => Preset {
            byte_encode: false,
            escape_whitespace: true,
            ..rules(RULES_NEWLINES)
        },
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "megrez" | "hunyuan"
        | "solar-open" | "grok-2" => rules(RULES_QWEN2),
        "qwen35" => rules(RULES_QWEN35),
        "dbrx" | "smaug-bpe" => rules(RULES_LLAMA3),
        "poro-chat" | "bloom" | "gpt3-finnish" => rules(RULES_FINNISH),
        "chatglm-bpe" => Preset {
            no_default_bos: true,
            ..rules(RULES_LLAMA3)
        },
        "glm4" | "glm5" => Preset {
            no_default_bos: true,
            ignore_merges: true,
            ..rules(RULES_LLAMA3)
        },
        "viking" => rules(RULES_VIKING),
        "tekken" => Preset {
            ignore_merges: true,
            add_bos: true,
            ..rules(RULES_TEKKEN)
        },
        "chameleon" => Preset {
            add_bos: true,
            ..rules(RULES_CHAMELEON)
        },
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => rules(RULES_GPT4O),
        "granite-embed-multi-97m" => Preset {
            ignore_merges: true,
            ..rules(RULES_GRANITE_EMB_MULTI)
        },
        "superbpe" => rules(RULES_SUPERBPE),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => rules(RULES_BAILINGMOE),
        "seed-coder" => rules(RULES_SEED_CODER),
        "ufakzeka" => rules(RULES_UFAKZEKA),
        "laguna" => rules(RULES_LAGUNA),
        "exaone-moe" => rules(RULES_EXAONE_MOE),
        _ => return None,
    };
    Some(p)
}

/// Every name [`preset`] accepts (for error messages and tests).
pub(crate) const KNOWN_PRE_NAMES: &[&str] = &[
    "default",
    "minicpm5",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "hunyuan-dense",
    "hy_v4",
    "joyai-llm",
    "spark2_5",
    "youtu",
    "falcon",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "exaone4",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "jais-2",
    "gemma4",
    "granite-embed-multi-311m",
    "sarvam-moe",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "stablelm2",
    "megrez",
    "hunyuan",
    "solar-open",
    "grok-2",
    "qwen35",
    "dbrx",
    "smaug-bpe",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "viking",
    "tekken",
    "chameleon",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "granite-embed-multi-97m",
    "superbpe",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "ufakzeka",
    "laguna",
    "exaone-moe",
];
