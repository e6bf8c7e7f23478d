"""Train the fixtures' byte-level BPE tokenizer (vocab 1024) on the pinned stdlib corpus.

Why this shape:
* Pre-tokenizer = transformers' Qwen3_5Tokenizer pipeline (NFC, Split(Qwen3.5 regex, isolated),
  ByteLevel(use_regex=False)) and a ByteLevel decoder. transformers 5 ignores tokenizer_class for
  model_type qwen3_5 and rebuilds that exact pipeline from vocab + merges (docs/fixture-pitfalls.md, P1), so
  any other pre-tokenizer would tokenize differently in the qwen3_5 folders.
* Special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2; eos <|im_end|>, pad <|endoftext|>,
  no bos. ChatML template that accepts string content and mlx-vlm's list-of-parts content (P3).
* tokenizer_class PreTrainedTokenizerFast (not the v5-only TokenizersBackend) and an inline
  chat_template in tokenizer_config.json, plus chat_template.jinja.
Deterministic: single-threaded training on a pinned corpus; a rerun gives identical bytes.

Usage: make_tokenizer.py [--out DIR]   (default golden/tokenizer)
"""

import common  # noqa: F401  (offline guard before transformers)

import argparse
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import corpus
from common import TOKENIZER, die, log, read_json, write_json

VOCAB_SIZE = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN35_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_texts():
    """Every pinned source file, then the chat pairs as plain role/question/answer lines."""
    sources = corpus.load_sources()
    yield from (text for _, text in sources)
    for q, a in corpus.chat_pairs(sources):
        yield f"user\n{q}\nassistant\n{a}\n"


def check_pipeline_matches_transformers():
    """Fail loudly if the installed transformers' Qwen3.5 regex is not the one copied here."""
    from transformers.models.qwen3_5 import tokenization_qwen3_5 as q

    if q.PRETOKENIZE_REGEX != QWEN35_REGEX:
        die("transformers' Qwen3_5Tokenizer regex changed; update QWEN35_REGEX")


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            die(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        die(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE} (corpus too small?)")
    return tok


def save(tok: Tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as tmp:
        wrapped.save_pretrained(tmp)
        produced = sorted(p.name for p in Path(tmp).iterdir())
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_bytes((Path(tmp) / "tokenizer.json").read_bytes())
        cfg = read_json(Path(tmp) / "tokenizer_config.json")
    log(f"save_pretrained wrote {produced}")
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
               add_bos_token=False, add_eos_token=False, bos_token=None)
    write_json(out / "tokenizer_config.json", dict(sorted(cfg.items())))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")  # no newline: same bytes as inline


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=TOKENIZER)
    args = ap.parse_args()
    check_pipeline_matches_transformers()
    try:
        tok = train()
    except corpus.CorpusError as e:
        die(str(e))
    save(tok, args.out.resolve())
    log(f"tokenizer: vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
