//! Tokenizer built from GGUF metadata.
