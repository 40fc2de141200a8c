//! Chat templates from `tokenizer.chat_template`.
