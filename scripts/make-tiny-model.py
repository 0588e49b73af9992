#!/usr/bin/env python3
"""Write a tiny random-weight Qwen3 model that real vLLM can serve, without downloading anything.

Usage: make-tiny-model.py DIR [--layers N] [--hidden N] [--heads N] [--kv-heads N] [--head-dim N]
                              [--vocab N] [--seed N]

The defaults give the shape vllm-facts.md describes: hidden 128, 2 layers, 4 heads, 2 KV heads,
head_dim 32, vocab 1024, bf16 — 512 bytes of KV cache per token, ~0.4 M parameters. The tokenizer is a
byte-level BPE trained on the spot on a small built-in text, so the model directory is self-contained.
Writing is atomic: the model appears under DIR only once complete; an existing complete DIR is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog today.",
    "tunerd supervises a vLLM inference server and tunes it while it runs.",
    "Hello world! How are you doing this fine morning? 0123456789",
    "Memory, page faults, migration bandwidth and KV-cache usage are watched together.",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-position", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` ids and save it with its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the text with numbered variants so BPE finds enough merges to fill the vocabulary.
    corpus = [f"{line} {i} {i * 7919}" for i in range(400) for line in TRAINING_TEXT]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    # Pad with placeholder tokens so ids cover the whole embedding table.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 1 << 20,
                "chat_template": (
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}"
                ),
            },
            indent=2,
        )
    )


def build_model(args: argparse.Namespace, out_dir: Path) -> None:
    """Save a random-weight Qwen3ForCausalLM in bf16 safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    target: Path = args.dir
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        print(f"model already present: {target}")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=target.parent))
    try:
        build_model(args, staging)
        train_tokenizer(args.vocab, staging)
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kv_bytes = args.layers * args.kv_heads * args.head_dim * 2 * 2
    print(f"tiny model written: {target} ({kv_bytes} bytes of KV cache per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
