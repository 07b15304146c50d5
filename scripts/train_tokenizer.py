"""Train the bundled model's byte-level BPE tokenizer on the train split and tokenize the splits.

    python scripts/train_tokenizer.py --corpus .data/corpus --out .data/tokenizer --vocab 8192

Writes a transformers tokenizer (``tokenizer.json`` + config) to ``--out`` and the token ids of
each split as ``<split>.u16.npy`` (the split's text as one stream) for training.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, default=Path(".data/corpus"))
    ap.add_argument("--out", type=Path, default=Path(".data/tokenizer"))
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()

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
    tok.train([str(args.corpus / "train.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)
    fast.padding_side = "left"
    args.out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(args.out)

    eos = tok.token_to_id(EOS)
    stats = {"vocab_size": tok.get_vocab_size(), "eos_id": eos, "pad_id": tok.token_to_id(PAD)}
    for split in ("train", "validation", "test"):
        text = (args.corpus / f"{split}.txt").read_text("utf-8")
        ids = tok.encode(text).ids  # the whole split as one stream, exactly as `quantmla eval ppl` reads it
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(args.out / f"{split}.u16.npy", arr)
        stats[f"{split}_tokens"] = int(arr.size)
        stats[f"{split}_bytes_per_token"] = round(len(text.encode("utf-8")) / max(1, arr.size), 3)
    (args.out / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
