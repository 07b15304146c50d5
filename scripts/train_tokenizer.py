"""Train the bundled model's byte-level BPE tokenizer on the train split and tokenize the splits.

    python scripts/train_tokenizer.py --corpus .data/corpus --out .data/tokenizer --vocab 8192
    python scripts/train_tokenizer.py --corpus .data/corpus-v2 --out .data/tokenizer-v2 \
        --tokenizer src/quantmla/assets/tiny-mla      # encode with the shipped tokenizer

Writes a transformers tokenizer (``tokenizer.json`` + config) to ``--out`` and the token ids of
each split as ``<split>.u16.npy`` for training. The validation and test splits are encoded as one stream
each, exactly as ``quantmla eval ppl`` reads them; a train split larger than ``--stream-mb`` is encoded in
pieces cut at paragraph breaks (``\n\n``), which can change the tokens at the cuts only. ``--train-mb``
trains the BPE on a deterministic sample of the train split (every k-th piece) instead of all of it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def _pieces(text: str, size: int = 1 << 20) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters at paragraph breaks (each cut before a
    ``\n\n``, which begins the next piece), so the pieces concatenate back to ``text``."""
    out, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + size)
        end = len(text) if cut < 0 else cut
        out.append(text[start:end])
        start = end
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, default=Path(".data/corpus"))
    ap.add_argument("--out", type=Path, default=Path(".data/tokenizer"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--train-mb", type=float, default=0.0, help="train the BPE on this many MB of the train split")
    ap.add_argument("--stream-mb", type=float, default=64.0, help="encode larger splits in pieces")
    ap.add_argument("--tokenizer", type=Path, default=None, help="encode with this tokenizer directory, no training")
    args = ap.parse_args()
    if args.vocab > 65536:
        raise SystemExit(f"--vocab {args.vocab}: the token ids are stored as uint16 (at most 65536)")

    train_text = (args.corpus / "train.txt").read_text("utf-8")
    if args.tokenizer is not None:
        tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        fast = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    else:
        tok, fast = _train(args, train_text)
    args.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)
    _encode(args, tok, train_text)


def _train(args: argparse.Namespace, train_text: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if args.train_mb > 0 and len(train_text) > args.train_mb * 1e6:
        pieces = _pieces(train_text)
        step = max(1, round(len(train_text) / (args.train_mb * 1e6)))
        tok.train_from_iterator(pieces[::step], trainer)
    else:
        tok.train([str(args.corpus / "train.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)
    fast.padding_side = "left"
    return tok, fast


def _encode(args: argparse.Namespace, tok: Tokenizer, train_text: str) -> None:
    eos = tok.token_to_id(EOS)
    stats = {"vocab_size": tok.get_vocab_size(), "eos_id": eos, "pad_id": tok.token_to_id(PAD)}
    for split in ("train", "validation", "test"):
        text = train_text if split == "train" else (args.corpus / f"{split}.txt").read_text("utf-8")
        if len(text) <= args.stream_mb * 1e6:
            ids = tok.encode(text).ids  # the whole split as one stream, exactly as `quantmla eval ppl` reads it
            arr = np.asarray(ids, dtype=np.uint16)
        else:
            pieces, parts = _pieces(text), []
            for i in range(0, len(pieces), 16):  # a few pieces at a time: an Encoding holds far more than ids
                parts += [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch(pieces[i : i + 16])]
            arr = np.concatenate(parts)
        np.save(args.out / f"{split}.u16.npy", arr)
        stats[f"{split}_tokens"] = int(arr.size)
        stats[f"{split}_bytes_per_token"] = round(len(text.encode("utf-8")) / max(1, arr.size), 3)
    (args.out / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
