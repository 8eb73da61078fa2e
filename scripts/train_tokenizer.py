#!/usr/bin/env python3
"""Train the default model's byte-level BPE tokenizer and pre-tokenize the train split.

Input: ``<build-dir>/train.jsonl`` from ``scripts/build_corpus.py`` (the held-out files are not
in it, so the tokenizer never sees them).

* Tokenizer: byte-level BPE (``tokenizers``), ``--vocab-size`` 8192 by default, with the
  Qwen2 pre-tokenizer regex (digits split one by one, whitespace runs kept together so Python
  indentation becomes few tokens). Special tokens: ``<|endoftext|>`` (id 0; eos, bos and pad),
  ``<|im_start|>`` and ``<|im_end|>`` (ChatML role markers used by the chat template). Saved as
  Hugging Face files (tokenizer.json, tokenizer_config.json with ``chat_template`` inline,
  special_tokens_map.json) so ``AutoTokenizer.from_pretrained(dir)`` loads it.
* Train tokens: every document encoded and followed by ``<|endoftext|>``, concatenated, stored
  as a compressed uint16 numpy array ``tokens`` in ``<out-dir>/train_tokens.npz``.

Usage: python scripts/train_tokenizer.py [--build-dir /tmp/pagedmoe_corpus] [--out-dir .carry]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# Qwen2's split regex: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, and whitespace runs (minus the last space before a word).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML. The model is trained on code plus a small synthetic ChatML set, so the markers are seen.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def iter_texts(path: str):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def build_tokenizer(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    return tok, trainer


def save_hf(tok: Tokenizer, out_dir: str, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=model_max_length,
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    # save_jinja_files=False keeps the template inline in tokenizer_config.json.
    fast.save_pretrained(out_dir, save_jinja_files=False)
    # transformers 5 writes its own class name ("TokenizersBackend"); the generic fast-tokenizer
    # name loads in transformers 4.x and 5.x alike.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    smap = {"eos_token": EOS, "bos_token": EOS, "pad_token": EOS,
            "additional_special_tokens": SPECIAL_TOKENS[1:]}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(smap, f, indent=2)


def encode_corpus(tok: Tokenizer, path: str, batch_docs: int = 2000) -> np.ndarray:
    eos_id = tok.token_to_id(EOS)
    chunks, batch = [], []
    for text in iter_texts(path):
        batch.append(text)
        if len(batch) == batch_docs:
            chunks += [np.array(e.ids + [eos_id], dtype=np.uint16) for e in tok.encode_batch(batch)]
            batch = []
    if batch:
        chunks += [np.array(e.ids + [eos_id], dtype=np.uint16) for e in tok.encode_batch(batch)]
    return np.concatenate(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="/tmp/pagedmoe_corpus")
    ap.add_argument("--out-dir", default=str(REPO / ".carry"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--model-max-length", type=int, default=2048)
    args = ap.parse_args()
    train_path = os.path.join(args.build_dir, "train.jsonl")
    tok_dir = os.path.join(args.out_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)

    t0 = time.time()
    tok, trainer = build_tokenizer(args.vocab_size)
    tok.train_from_iterator(iter_texts(train_path), trainer=trainer)
    assert tok.get_vocab_size() <= 65535, "token ids must fit uint16"
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    save_hf(tok, tok_dir, args.model_max_length)
    print(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.0f}s -> {tok_dir}")

    t0 = time.time()
    tokens = encode_corpus(tok, train_path)
    n_bytes = os.path.getsize(train_path)  # JSON-escaped size; only used for a rough ratio below
    np.savez_compressed(os.path.join(args.out_dir, "train_tokens.npz"), tokens=tokens)
    size = os.path.getsize(os.path.join(args.out_dir, "train_tokens.npz"))
    print(f"train tokens: {len(tokens):,} ({n_bytes / len(tokens):.2f} jsonl bytes/token) "
          f"encoded in {time.time() - t0:.0f}s; npz {size / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
