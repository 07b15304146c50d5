"""Synthetic retrieval sequences mixed into the bundled model's training.

A model of ~9M parameters trained on code alone does not learn to fetch a value stated thousands of tokens
earlier reliably enough to show cache damage. So a documented share of the training rows are synthetic
retrieval sequences, as in RULER-style long-context training:

* a haystack of ``seq`` tokens: a crop of the train split, or (one row in four) a short crop of it repeated
  (the analogue of RULER's repeated-noise haystack);
* ``1..max_needles`` needles at random depths, each from a **training template** of
  :mod:`quantmla.eval.needles` (statements, key-value lines, code, JSON records, dialogue; RULER's sentence among
  them), the template drawn per needle;
* then, for a random subset of the needles, each one's question and answer, one after the other, so a row trains
  several answers.

What is shared with the evaluation (``quantmla eval niah``) and what is not:

* never in training: the **held-out templates** (the evaluation's default) and their key words
  (:data:`~quantmla.eval.needles.HELDOUT_WORDS`), and the keys the evaluation asks with the training templates
  (:data:`~quantmla.eval.needles.EVAL_TRAIN_KEYS`); checked by a test;
* keys here: two words of :data:`~quantmla.eval.needles.TRAIN_WORDS`, or one and a number; values: numbers,
  hex strings and letter codes, fresh; haystacks: the train split, never the validation or test text.

Everything is token-level splicing, like the evaluation's prompts, and deterministic from the generator.
"""

from __future__ import annotations

import numpy as np

from quantmla.eval.needles import TRAIN_WORDS, templates, train_key

WORDS = TRAIN_WORDS


def _key(rng: np.random.Generator) -> str:
    if rng.random() < 0.25:  # a word and a number
        return f"{WORDS[int(rng.integers(0, len(WORDS)))]}-{int(rng.integers(10, 1000))}"
    return train_key(rng)


def _value(rng: np.random.Generator) -> str:
    u = rng.random()
    if u < 0.3:
        h = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, 12))
        return f"{h[:4]}-{h[4:8]}-{h[8:]}"
    if u < 0.45:  # a letter code
        letters = "".join("ABCDEFGHJKLMNPQRSTUVWXYZ"[i] for i in rng.integers(0, 24, 2))
        return f"{letters}-{int(rng.integers(10_000, 100_000))}"
    return str(int(rng.integers(1_000_000, 10_000_000)))


class RetrievalMix:
    """Builds synthetic retrieval rows of exactly ``seq + 1`` tokens (inputs and shifted targets)."""

    def __init__(self, tokenizer, train: np.ndarray, seq: int, max_needles: int = 8, pool: int = 4096,
                 seed: int = 0) -> None:  # fmt: skip
        if seq < 512:
            raise ValueError(f"seq={seq}: retrieval rows need at least 512 tokens")
        self.train, self.seq, self.max_needles = train, seq, max_needles
        rng = np.random.default_rng(seed)
        keys = [_key(rng) for _ in range(pool)]
        values = [_value(rng) for _ in keys]
        train = templates("train")
        self.templates = [train[int(i)].name for i in rng.integers(0, len(train), pool)]
        by_name = {t.name: t for t in train}
        texts = [by_name[n].texts(k, v) for n, k, v in zip(self.templates, keys, values, strict=True)]

        def enc(texts):
            return [np.asarray(e, dtype=np.int64) for e in tokenizer(texts, add_special_tokens=False)["input_ids"]]

        self.needles = enc([t[0] for t in texts])
        self.questions = enc([t[1] for t in texts])
        self.answers = enc([t[2] for t in texts])

    def row(self, rng: np.random.Generator) -> np.ndarray:
        """One row of ``seq + 1`` tokens."""
        return self.row_parts(rng)[0]

    def row_parts(self, rng: np.random.Generator) -> tuple[np.ndarray, list[int], list[int]]:
        """``(row, the needles it states, the ones it asks)`` (indices into the pool)."""
        n = self.seq + 1
        k = int(rng.integers(1, self.max_needles + 1))
        picks = rng.choice(len(self.needles), size=k, replace=False)
        asked = picks[: int(rng.integers(1, k + 1))]
        qa = [np.concatenate([self.questions[i], self.answers[i]]) for i in rng.permutation(asked)]
        tail = np.concatenate(qa)
        room = n - len(tail) - sum(len(self.needles[i]) for i in picks)
        if rng.random() < 0.25:  # a short crop repeated: the repeated-noise haystack
            w = int(rng.integers(16, 128))
            s = int(rng.integers(0, len(self.train) - w))
            hay = np.resize(self.train[s : s + w].astype(np.int64), room)
        else:
            s = int(rng.integers(0, len(self.train) - room))
            hay = self.train[s : s + room].astype(np.int64)
        spots = np.sort(rng.integers(0, room + 1, size=k))
        parts, prev = [], 0
        for spot, i in zip(spots, picks, strict=True):
            parts += [hay[prev:spot], self.needles[i]]
            prev = spot
        out = np.concatenate([*parts, hay[prev:], tail])
        assert len(out) == n, (len(out), n)
        return out, [int(i) for i in picks], [int(i) for i in asked]
