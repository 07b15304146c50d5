"""Synthetic retrieval sequences mixed into the bundled model's training.

A model of ~9M parameters trained on code alone does not learn to fetch a value stated thousands of tokens
earlier reliably enough to show cache damage. So a documented share of the training rows are synthetic
retrieval sequences, as in RULER-style long-context training:

* a haystack of ``seq`` tokens: a crop of the train split, or (one row in four) a short crop of it repeated
  (the analogue of RULER's repeated-noise haystack);
* ``1..max_needles`` needles at random depths, each from a training template: one of the seven fixed training
  templates of :mod:`quantmla.eval.needles` (RULER's sentence among them) or, for ``generated`` of the pool, one
  composed by the grammar of ``needle_grammar.py`` (statements, key-value lines, code, JSON records, dialogue and
  notes; copy cues and cues in other words; ``family_weights`` draws its families, composed records among them, at
  given frequencies instead of uniformly); the pool comes in groups of four needles of one template and
  different keys, and ``same_template`` of the rows take all their needles from one group, so the key, not the
  wording, tells the needles apart;
* then, for a random subset of the needles (all of them in ``ask_all`` of the rows), each one's question and answer,
  one after the other, so a row trains several answers;
* ``copy_rows`` of the rows are span-copy rows instead: a crop of the train split, then, each after a newline, 4 to 12
  spans of 8 to 24 tokens copied from it, each one starting with tokens found nowhere else in the crop (so what follows
  is determined by the crop). They train what the held-out templates with a copy cue ask in a layout never seen: find
  where the last tokens occurred and continue from there, whatever the wording;
* ``end_needle`` of the rows place one asked needle right before the questions (the evaluation's depth 100%: at
  uniform depths one needle in a hundred lands in the last 1% of the haystack, almost none right at its end);
* ``start_needle`` of the rows place one asked needle at the haystack's first token (the evaluation's depth 0%, where
  the MLAfication teacher found 3 of 18 needles: at uniform depths almost none lands right at the start);
* ``short_episodes`` of the rows hold the haystack, needles and questions in their first ``L`` tokens, ``L`` uniform
  from 1,024 (or ``seq``, if shorter) to ``seq``, then a newline and a crop of the train split: questions asked at
  the evaluation's shorter lengths (1K, 2K) instead of always at the row's end.

What is shared with the evaluation (``quantmla eval niah``) and what is not:

* never in training: the **held-out templates** (the evaluation's default) and their key words
  (:data:`~quantmla.eval.needles.HELDOUT_WORDS`), and the keys the evaluation asks with the training templates
  (:data:`~quantmla.eval.needles.EVAL_TRAIN_KEYS`); checked by a test;
* keys here: two words of :data:`~quantmla.eval.needles.TRAIN_WORDS`, or one and a number; values: numbers,
  hex strings and letter codes, fresh; haystacks: the train split, never the validation or test text.

Everything is token-level splicing, like the evaluation's prompts, and deterministic from the generator.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from quantmla.eval.needles import TRAIN_WORDS, templates, train_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle_grammar import check_weights, generate  # noqa: E402

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

    GROUP = 4  # needles of one template in a row of ``same_template``

    def __init__(self, tokenizer, train: np.ndarray, seq: int, max_needles: int = 8, pool: int = 4096,
                 seed: int = 0, generated: float = 0.0, same_template: float = 0.0, ask_all: float = 0.0,
                 copy_rows: float = 0.0, family_weights: Mapping[str, float] | None = None,
                 end_needle: float = 0.0, short_episodes: float = 0.0,
                 start_needle: float = 0.0) -> None:  # fmt: skip
        if seq < 512:
            raise ValueError(f"seq={seq}: retrieval rows need at least 512 tokens")
        for name, share in (("generated", generated), ("same_template", same_template), ("ask_all", ask_all),
                            ("copy_rows", copy_rows), ("end_needle", end_needle),
                            ("short_episodes", short_episodes), ("start_needle", start_needle)):  # fmt: skip
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name}={share}: a share in [0, 1]")
        if family_weights is not None:
            check_weights(family_weights)
        self.train, self.seq, self.max_needles, self.same_template = train, seq, max_needles, same_template
        self.ask_all, self.copy_rows = ask_all, copy_rows
        self.end_needle, self.short_episodes, self.start_needle = end_needle, short_episodes, start_needle
        self.newline = np.asarray(tokenizer("\n", add_special_tokens=False)["input_ids"], dtype=np.int64)
        rng = np.random.default_rng(seed)
        fixed = templates("train")
        groups = []
        for g in range(max(1, pool // self.GROUP)):
            pick = rng.random() < generated
            groups.append(generate(rng, g, family_weights) if pick else fixed[int(rng.integers(0, len(fixed)))])
        chosen = [t for t in groups for _ in range(self.GROUP)]
        keys = []
        for i in range(len(chosen)):  # distinct keys within a group
            key = _key(rng)
            while key in keys[i - i % self.GROUP :]:
                key = _key(rng)
            keys.append(key)
        values = [_value(rng) for _ in keys]
        self.templates = [t.name for t in chosen]
        self.families = [t.family for t in chosen]
        self.template_texts = {t.name: t.needle + t.question for t in chosen}
        texts = [t.texts(k, v) for t, k, v in zip(chosen, keys, values, strict=True)]

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
        if self.copy_rows and rng.random() < self.copy_rows:
            return self.copy_row(rng)[0], [], []
        if rng.random() < self.same_template:  # all needles of one template, told apart by their keys
            g = int(rng.integers(0, len(self.needles) // self.GROUP))
            k = int(rng.integers(1, min(self.GROUP, self.max_needles) + 1))
            picks = g * self.GROUP + rng.choice(self.GROUP, size=k, replace=False)
        else:
            k = int(rng.integers(1, self.max_needles + 1))
            picks = rng.choice(len(self.needles), size=k, replace=False)
        # (no draw without ask_all or copy_rows: the rows of runs made before them stay what their seed gave)
        ask_all = self.ask_all and rng.random() < self.ask_all
        asked = picks if ask_all else picks[: int(rng.integers(1, k + 1))]
        qa = [np.concatenate([self.questions[i], self.answers[i]]) for i in rng.permutation(asked)]
        tail = np.concatenate(qa)
        # (the draws below happen only where their share is set: earlier runs' rows stay what their seed gave)
        at_end = bool(self.end_needle) and rng.random() < self.end_needle
        episode = n
        if self.short_episodes and rng.random() < self.short_episodes:
            episode = int(rng.integers(min(n, 1024), n + 1))
        stated = sum(len(self.needles[i]) for i in picks)
        episode = max(episode, min(n, len(tail) + stated + 64))  # room for some haystack
        if episode > n - len(self.newline) - 1:  # no room for the newline and some text after it
            episode = n
        room = episode - len(tail) - stated
        if rng.random() < 0.25:  # a short crop repeated: the repeated-noise haystack
            w = int(rng.integers(16, 128))
            s = int(rng.integers(0, len(self.train) - w))
            hay = np.resize(self.train[s : s + w].astype(np.int64), room)
        else:
            s = int(rng.integers(0, len(self.train) - room))
            hay = self.train[s : s + room].astype(np.int64)
        spots = np.sort(rng.integers(0, room + 1, size=k))
        if at_end:  # one asked needle last, its end where the questions start
            last = asked[int(rng.integers(0, len(asked)))]
            picks = np.asarray([i for i in picks if i != last] + [last])
            spots[-1] = room
        if self.start_needle and rng.random() < self.start_needle:  # one asked needle first (not the one at the end)
            free = [i for i in asked if not (at_end and i == picks[-1])]
            if free:
                first = free[int(rng.integers(0, len(free)))]
                picks = np.asarray([first] + [i for i in picks if i != first])
                spots[0] = 0
        parts, prev = [], 0
        for spot, i in zip(spots, picks, strict=True):
            parts += [hay[prev:spot], self.needles[i]]
            prev = spot
        parts += [hay[prev:], tail]
        if episode < n:  # a short episode, then ordinary text
            filler = n - episode - len(self.newline)
            s = int(rng.integers(0, len(self.train) - filler))
            parts += [self.newline, self.train[s : s + filler].astype(np.int64)]
        out = np.concatenate(parts)
        assert len(out) == n, (len(out), n)
        return out, [int(i) for i in picks], [int(i) for i in asked]

    def copy_row(self, rng: np.random.Generator, min_cue: int = 3,
                 tries: int = 64) -> tuple[np.ndarray, list[tuple[int, int]]]:  # fmt: skip
        """A span-copy row of ``seq + 1`` tokens and its spans ``(start in the row, length)``: a crop, then spans of
        it, each after a newline, each starting with ``min_cue`` tokens that occur nowhere else in the crop (of
        ``tries`` random starts the first such one; if none is, the start whose first tokens occur least often)."""
        n = self.seq + 1
        lengths = rng.integers(8, 25, size=int(rng.integers(4, 13)))
        room = n - int(lengths.sum()) - len(lengths) * len(self.newline)
        s = int(rng.integers(0, len(self.train) - room))
        hay = self.train[s : s + room].astype(np.int64)
        grams = np.lib.stride_tricks.sliding_window_view(hay, min_cue)
        parts, spans = [], []
        for length in lengths:
            best = (room + 1, 0)
            for _ in range(tries):
                p = int(rng.integers(0, room - length + 1))
                count = int((grams == hay[p : p + min_cue]).all(axis=1).sum())
                best = min(best, (count, p))
                if count == 1:
                    break
            parts += [self.newline, hay[best[1] : best[1] + length]]
            spans.append((best[1], int(length)))
        out = np.concatenate([hay, *parts])
        assert len(out) == n, (len(out), n)
        return out, spans
