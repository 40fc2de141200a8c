#!/usr/bin/env python3
"""Train the demo model's byte-level BPE vocabulary on the training split (never on val).

Pre-tokenization is exactly GPT-2's (`ByteLevel(use_regex=True)`: the regex
`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` and the byte-to-unicode
mapping, no normaliser), so llama.cpp / moeshard with `tokenizer.ggml.pre = "gpt-2"` encode text to
the same ids as this `tokenizers` tokenizer. GPT-2's split (rather than Qwen2's) keeps "\n" apart
from punctuation, so the prompt "ROMEO:" tokenizes as a prefix of the corpus' "ROMEO:\n".

Special token: `<|endoftext|>` = id 0, used as BOS (prepended to every training window and, via
`add_bos_token`, to prompts) and as EOS.

Usage: train_tokenizer.py [--data DIR] [--out DIR] [--vocab-size 6144]
Writes tokenizer.json + tokenizer_config.json into --out (the HF checkpoint directory).
"""
import argparse
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CACHE = Path(os.environ.get("MOESHARD_CACHE", REPO / ".cache"))

EOT = "<|endoftext|>"

# Plain-text "chat" template: every message is a speech headed by its speaker, as in the corpus.
# user -> ROMEO, assistant -> JULIET (a message's `name` overrides), system -> a bare paragraph.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ message['content'] + '\\n\\n' }}"
    "{%- else -%}"
    "{%- if message['name'] is defined and message['name'] -%}{%- set speaker = message['name'] -%}"
    "{%- elif message['role'] == 'user' -%}{%- set speaker = 'ROMEO' -%}"
    "{%- else -%}{%- set speaker = 'JULIET' -%}{%- endif -%}"
    "{{ (speaker | upper) + ':\\n' + message['content'] + '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'JULIET:\\n' }}{%- endif -%}"
)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    # BOS on every encoded text (add_bos_token), like the engine does with tokenizer.ggml.add_bos_token
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)]),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(CACHE / "demo-model" / "data"))
    ap.add_argument("--out", default=str(CACHE / "demo-model" / "hf"))
    ap.add_argument("--vocab-size", type=int, default=6144)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (Path(args.data) / "train.txt").read_text(encoding="utf-8")
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size, min_frequency=2, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    # one "sentence" per paragraph; BPE training is deterministic for fixed input
    paras = [p for p in text.split("\n\n") if p]
    tok.train_from_iterator(paras, trainer=trainer, length=len(paras))
    assert tok.token_to_id(EOT) == 0
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 512, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, indent=1))
    n_tok = len(tok.encode(text, add_special_tokens=False).ids)
    print(f"vocab {tok.get_vocab_size()}  train tokens {n_tok}  chars/token {len(text) / n_tok:.2f}")


if __name__ == "__main__":
    main()
