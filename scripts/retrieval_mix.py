"""Synthetic retrieval sequences mixed into the bundled model's training (issue 17, model v2).

A model of ~9M parameters trained on code alone does not learn to fetch a value stated thousands of tokens
earlier reliably enough to show cache damage. So a documented share of the training rows are synthetic
retrieval sequences, as in RULER-style long-context training:

* a haystack of ``seq`` tokens: a crop of the train split, or (one row in four) a short crop of it repeated
  (the analogue of RULER's repeated-noise haystack);
* ``1..max_needles`` needles "One of the special magic numbers for KEY is: VALUE." at random depths;
* then, for a random subset of the needles, the question quantmla's NIAH asks and its answer, one after
  the other, so a row trains several answers.

What is shared with the evaluation (``quantmla.eval.niah``) and what is not:

* shared: the needle and question sentences (the evaluation's templates);
* disjoint: the keys (two words drawn from :data:`WORDS`, none of which occurs in the evaluation's keys,
  checked by a test), the values (fresh random numbers and hex strings) and the haystacks (the train split,
  never the validation or test text the evaluation uses).

Everything is token-level splicing, like the evaluation's prompts, and deterministic from the generator.
"""

from __future__ import annotations

import numpy as np

WORDS = (
    "acorn", "alpine", "anchor", "arctic", "autumn", "badger", "bamboo", "basalt", "beacon", "birch", "bison",
    "bramble", "bronze", "cactus", "canyon", "cedar", "chalk", "cherry", "cinder", "clover", "cobalt", "coral",
    "cotton", "crane", "crimson", "crystal", "cypress", "delta", "desert", "dune", "eagle", "ember", "fern",
    "fjord", "flint", "forest", "frost", "garnet", "glacier", "granite", "gravel", "hazel", "heron", "hollow",
    "indigo", "ivory", "jade", "jasper", "juniper", "kestrel", "lagoon", "larch", "lava", "lemon", "lilac",
    "linen", "lotus", "lunar", "maple", "marble", "meadow", "mercury", "mint", "misty", "onyx", "opal",
    "orange", "otter", "pebble", "pepper", "pine", "plum", "polar", "poplar", "prairie", "quartz", "raven",
    "reed", "ridge", "robin", "ruby", "rust", "saffron", "sage", "salt", "sandy", "scarlet", "shadow",
    "silver", "slate", "snowy", "spruce", "storm", "summit", "swift", "tawny", "thistle", "thunder", "timber",
    "topaz", "tulip", "tundra", "velvet", "walnut", "willow", "winter", "wren", "yellow", "zephyr",
)  # fmt: skip


def _needle(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}. "


def _question(key: str) -> str:
    return (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is:")  # fmt: skip


def _value(rng: np.random.Generator) -> str:
    if rng.random() < 0.3:
        h = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, 12))
        return f"{h[:4]}-{h[4:8]}-{h[8:]}"
    return str(int(rng.integers(1_000_000, 10_000_000)))


class RetrievalMix:
    """Builds synthetic retrieval rows of exactly ``seq + 1`` tokens (inputs and shifted targets)."""

    def __init__(self, tokenizer, train: np.ndarray, seq: int, max_needles: int = 8, pool: int = 4096,
                 seed: int = 0) -> None:  # fmt: skip
        if seq < 512:
            raise ValueError(f"seq={seq}: retrieval rows need at least 512 tokens")
        self.train, self.seq, self.max_needles = train, seq, max_needles
        rng = np.random.default_rng(seed)
        keys = [f"{WORDS[a]}-{WORDS[b]}" for a, b in rng.integers(0, len(WORDS), (pool, 2)) if a != b]
        values = [_value(rng) for _ in keys]

        def enc(texts):
            return [np.asarray(e, dtype=np.int64) for e in tokenizer(texts, add_special_tokens=False)["input_ids"]]

        self.needles = enc([_needle(k, v) for k, v in zip(keys, values, strict=True)])
        self.questions = enc([_question(k) for k in keys])
        self.answers = enc([" " + v + "." for v in values])

    def row(self, rng: np.random.Generator) -> np.ndarray:
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
        return out
