"""The synthetic retrieval rows mixed into the bundled model's training: exact length, the needles and their answers
where they should be, every training template used, determinism, and nothing of the held-out evaluation (its
templates, its key words, the keys asked with the training templates) in training."""

import re
from functools import partial

import numpy as np
import pytest

from quantmla.eval import needles
from quantmla.models.loading import builtin_path
from script_modules import load_script

_module = partial(load_script, "scripts/retrieval_mix.py")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("tiny-mla"))


def _find(row: np.ndarray, part: np.ndarray, start: int = 0) -> int:
    """Where ``part`` first occurs in ``row`` at or after ``start`` (-1: nowhere)."""
    for i in range(start, len(row) - len(part) + 1):
        if np.array_equal(row[i : i + len(part)], part):
            return i
    return -1


def test_rows_have_the_length_their_needles_and_answers(tok):
    rm = _module()
    train = np.arange(2, 3000, dtype=np.uint16) % 8000 + 2
    mix = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        row, stated, asked = mix.row_parts(rng)
        assert row.shape == (1025,) and row.dtype == np.int64 and asked and set(asked) <= set(stated)
        first_q = min(_find(row, mix.questions[i]) for i in asked)
        for i in stated:  # every needle is stated before the questions
            assert 0 <= _find(row, mix.needles[i]) < first_q, i
        for i in asked:  # each asked question is followed by its answer
            q = _find(row, mix.questions[i], first_q)
            assert q >= 0 and np.array_equal(row[q + len(mix.questions[i]) :][: len(mix.answers[i])], mix.answers[i])
    again = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert np.array_equal(mix.row(a), again.row(b))


def test_training_draws_every_training_template_and_nothing_held_out(tok):
    rm = _module()
    mix = rm.RetrievalMix(tok, np.arange(2, 3000, dtype=np.uint16), seq=1024, pool=2048, seed=0, generated=0.7)
    train = {t.name for t in needles.templates("train")}
    fixed = {n for n in mix.templates if not n.startswith("gen-")}
    assert fixed == train  # every fixed training phrasing, none other
    generated = {n for n in mix.templates if n.startswith("gen-")}
    assert 0.6 < len(generated) / (len(mix.templates) / mix.GROUP) < 0.8  # one template a group of four
    assert {f for n, f in zip(mix.templates, mix.families, strict=True) if n.startswith("gen-")} == {
        "statement", "kv", "code", "json", "dialogue", "record"}  # fmt: skip
    assert len({mix.template_texts[n] for n in generated}) > 150  # many distinct phrasings, not a few repeated
    assert not train & {t.name for t in needles.templates("heldout")}
    held_words = set(needles.HELDOUT_WORDS)
    eval_words = {w for k in needles.EVAL_TRAIN_KEYS for w in k.split("-")}
    assert not held_words & set(rm.WORDS) and not eval_words & set(rm.WORDS) and not eval_words & held_words
    # no held-out template's fixed text (its words around the placeholders) occurs in a training template
    import re

    train_text = " ".join(mix.template_texts.values())
    for t in needles.templates("heldout"):
        for piece in re.split(r"\{[a-z_]+\}", t.needle + t.question):
            if len(piece.strip()) >= 12:
                assert piece.strip() not in train_text, (t.name, piece)


def test_the_grammar_never_uses_a_held_out_word():
    """The held-out templates' own nouns and layouts stay out of every generated template."""
    grammar = load_script("scripts/needle_grammar.py")
    rng = np.random.default_rng(3)
    every = dict.fromkeys(grammar.WEIGHTED_FAMILIES, 1.0)
    texts = [t.needle + t.question for t in (grammar.generate(rng, i) for i in range(3000))]
    texts += [t.needle + t.question for t in (grammar.generate(rng, i, every) for i in range(3000))]
    for word in ("locker", "combination", "serial", "device", "reference number", "Subject:", "Regards", "const ",
                 "| ", "do not change"):  # fmt: skip
        assert not any(word in x for x in texts), word
    joined = " ".join(texts)  # nor any held-out template's fixed text (its words between placeholders)
    for t in needles.templates("heldout"):
        for piece in re.split(r"\{[a-z_]+\}", t.needle + t.question):
            if len(piece.strip()) >= 12:
                assert piece.strip() not in joined, (t.name, piece)
    # every template formats (its placeholders are ones NeedleTemplate fills) and states the value once
    for t in [grammar.generate(rng, i) for i in range(300)] + [grammar.generate(rng, i, every) for i in range(300)]:
        needle, question, answer = t.texts("maple-otter", "4821-ab")
        assert needle.count("4821-ab") == 1 and "4821-ab" not in question and "{" not in needle.replace('{"', "")


def test_family_weights_set_how_often_each_family_is_drawn(tok):
    grammar = load_script("scripts/needle_grammar.py")
    rng = np.random.default_rng(4)
    drawn = [grammar.generate(rng, i, {"memo": 3.0, "kv": 1.0}).family for i in range(2000)]
    assert set(drawn) == {"memo", "kv"}  # a family not named is never drawn
    assert 0.72 < drawn.count("memo") / len(drawn) < 0.78  # 3 : 1 (binomial sd 0.01)
    memos = [grammar.generate(rng, i, {"memo": 1.0}) for i in range(400)]
    assert len({t.needle + t.question for t in memos}) > 300  # composed, not a few fixed frames
    for t in memos:  # the key on its own line above the value's line; the cue does not quote the value's line
        needle, question, answer = t.texts("maple-otter", "4821-ab")
        lines = needle.strip("\n").split("\n")
        assert "maple-otter" in lines[0] and "4821-ab" in lines[-1] and "maple-otter" not in lines[-1]
        cue = question.split("?")[-1].strip()
        before = lines[-1].split("4821-ab")[0].strip()
        assert not before or not before.endswith(cue), (needle, question)
    rows = [grammar.generate(rng, i, {"delimited": 1.0}) for i in range(300)]
    assert len({t.needle + t.question for t in rows}) > 100
    for t in rows:  # a copy cue is the row up to the value; the answer ends at the row's next delimiter
        needle, question, answer = t.texts("maple-otter", "4821-ab")
        line = needle.strip("\n")
        if not question.endswith("Answer:"):
            cue = question.split("\n")[-1]
            assert line.startswith(cue + answer), (line, cue, answer)
            assert answer.startswith(" 4821-ab ") and line.endswith(answer.split()[-1])
    assert {t.question.endswith("Answer:") for t in rows} == {True, False}  # both kinds of cue
    mix = _module().RetrievalMix(tok, np.arange(2, 3000, dtype=np.uint16), seq=1024, pool=256, seed=0, generated=1.0,
                                 family_weights={"memo": 1.0})  # fmt: skip
    assert set(mix.families) == {"memo"}
    for bad, match in (({"memo": -1.0}, "each >= 0"), ({"letter": 1.0}, "unknown letter; valid: statement"),
                       ({"kv": 0.0}, "sum > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            grammar.generate(rng, 0, bad)
        with pytest.raises(ValueError, match=match):
            _module().RetrievalMix(tok, np.arange(5000, dtype=np.uint16), seq=1024, family_weights=bad)
    assert grammar.parse_weights("memo=3, record=2") == {"memo": 3.0, "record": 2.0}
    with pytest.raises(ValueError, match="'memo' is not FAMILY=NUMBER"):
        grammar.parse_weights("memo")


def test_rows_of_one_template_tell_needles_apart_by_key(tok):
    rm = _module()
    mix = rm.RetrievalMix(tok, np.arange(2, 3000, dtype=np.uint16), seq=1024, pool=256, seed=2, generated=0.5,
                          same_template=1.0)  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(20):
        _, stated, _ = mix.row_parts(rng)
        assert len({mix.templates[i] for i in stated}) == 1 and len(stated) <= mix.GROUP
    keys = [tuple(mix.needles[i]) for i in range(mix.GROUP)]
    assert len(set(keys)) == mix.GROUP  # a group's needles differ (their keys and values)


def test_short_rows_are_refused(tok):
    rm = _module()
    with pytest.raises(ValueError, match="seq=256"):
        rm.RetrievalMix(tok, np.arange(5000, dtype=np.uint16), seq=256)
    with pytest.raises(ValueError, match="generated=1.5"):
        rm.RetrievalMix(tok, np.arange(5000, dtype=np.uint16), seq=1024, generated=1.5)


def test_span_copy_rows_repeat_spans_whose_first_tokens_are_unique(tok):
    """Each span after the crop is a copy of the crop at its start, after a newline, and its first three tokens occur
    once in the crop (so the rest is determined): in a haystack of repeated text with a fresh token every 20, where
    few starts are such, they are still found."""
    rm = _module()
    rng = np.random.default_rng(0)
    text = np.tile(np.arange(10, 30), 400)
    text[::20] = rng.choice(np.arange(100, 8000), size=400, replace=False)
    mix = rm.RetrievalMix(tok, text.astype(np.uint16), seq=1024, pool=16, seed=0, copy_rows=1.0)
    nl = mix.newline
    for _ in range(30):
        row, spans = mix.copy_row(rng)
        assert row.shape == (1025,) and 4 <= len(spans) <= 12
        tail = sum(length + len(nl) for _, length in spans)
        hay, pos = row[: len(row) - tail], len(row) - tail
        for start, length in spans:
            assert np.array_equal(row[pos : pos + len(nl)], nl)
            copy = row[pos + len(nl) : pos + len(nl) + length]
            assert np.array_equal(copy, hay[start : start + length]) and 8 <= length <= 24
            grams = np.lib.stride_tricks.sliding_window_view(hay, 3)
            assert (grams == copy[:3]).all(axis=1).sum() == 1, (start, copy[:3])
            pos += len(nl) + length
        assert pos == len(row)
    assert mix.row_parts(rng)[1:] == ([], [])  # a copy row states and asks no needle


def test_ask_all_asks_every_stated_needle(tok):
    rm = _module()
    mix = rm.RetrievalMix(tok, np.arange(2, 3000, dtype=np.uint16), seq=1024, pool=64, seed=1, ask_all=1.0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        _, stated, asked = mix.row_parts(rng)
        assert sorted(asked) == sorted(stated)
    with pytest.raises(ValueError, match="copy_rows=2"):
        rm.RetrievalMix(tok, np.arange(5000, dtype=np.uint16), seq=1024, copy_rows=2)


def _episode(mix, row, asked):
    """Where the first question starts and where the last answer ends in ``row``."""
    first_q = min(_find(row, mix.questions[i]) for i in asked)
    ends = []
    for i in asked:
        q = _find(row, mix.questions[i], first_q)
        ends.append(q + len(mix.questions[i]) + len(mix.answers[i]))
    return first_q, max(ends)


def test_end_needle_puts_an_asked_needle_right_before_the_questions(tok):
    rm = _module()
    train = np.arange(2, 3000, dtype=np.uint16) % 8000 + 2
    rng = np.random.default_rng(0)
    mix = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1, end_needle=1.0)
    for _ in range(20):
        row, stated, asked = mix.row_parts(rng)
        first_q, _ = _episode(mix, row, asked)
        adjacent = [i for i in asked if np.array_equal(row[first_q - len(mix.needles[i]) : first_q], mix.needles[i])]
        assert adjacent, "no asked needle ends where the questions start"
        assert all(0 <= _find(row, mix.needles[i]) < first_q for i in stated)
    # without it, depths are uniform: the needle is rarely adjacent (the check above fails on some row)
    plain = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    rng = np.random.default_rng(0)
    misses = 0
    for _ in range(20):
        row, _, asked = plain.row_parts(rng)
        first_q, _ = _episode(plain, row, asked)
        misses += not any(
            np.array_equal(row[first_q - len(plain.needles[i]) : first_q], plain.needles[i]) for i in asked
        )
    assert misses > 10, misses


def test_start_needle_puts_an_asked_needle_at_the_haystacks_first_token(tok):
    rm = _module()
    train = np.arange(2, 3000, dtype=np.uint16) % 8000 + 2
    for end in (0.0, 1.0):  # with end_needle too: the start needle is another asked one, where there is one
        mix = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1, start_needle=1.0, end_needle=end)
        rng = np.random.default_rng(0)
        starts = 0
        for _ in range(20):
            row, stated, asked = mix.row_parts(rng)
            first_q, _ = _episode(mix, row, asked)
            at_start = [i for i in asked if np.array_equal(row[: len(mix.needles[i])], mix.needles[i])]
            starts += bool(at_start)
            assert all(0 <= _find(row, mix.needles[i]) < first_q for i in stated)
            if end:  # an asked needle still ends where the questions start
                assert any(np.array_equal(row[first_q - len(mix.needles[i]) : first_q], mix.needles[i]) for i in asked)
        # every row, but for those whose one asked needle is the end one
        assert starts == 20 if not end else starts >= 10, (end, starts)
    # without it, depths are uniform: a needle at the very first token is rare
    plain = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(20):
        row, _, asked = plain.row_parts(rng)
        hits += any(np.array_equal(row[: len(plain.needles[i])], plain.needles[i]) for i in asked)
    assert hits < 5, hits


def test_start_needle_share_unset_leaves_the_rows_as_before(tok):
    rm = _module()
    train = np.arange(2, 3000, dtype=np.uint16) % 8000 + 2
    a = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1, end_needle=0.5)
    b = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1, end_needle=0.5, start_needle=0.0)
    ra, rb = np.random.default_rng(7), np.random.default_rng(7)
    for _ in range(10):
        assert np.array_equal(a.row(ra), b.row(rb))


def test_short_episodes_end_early_then_continue_with_train_text(tok):
    rm = _module()
    train = np.random.default_rng(3).integers(2, 8000, 20000).astype(np.uint16)  # its 8-grams occur once
    mix = rm.RetrievalMix(tok, train, seq=4096, pool=64, seed=1, short_episodes=1.0)
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(12):
        row, stated, asked = mix.row_parts(rng)
        assert row.shape == (4097,)
        first_q, end = _episode(mix, row, asked)
        assert all(0 <= _find(row, mix.needles[i]) < first_q for i in stated)
        lengths.append(end)
        if end < 4097:  # a newline, then a contiguous crop of the train split to the row's end
            nl = len(mix.newline)
            assert np.array_equal(row[end : end + nl], mix.newline)
            rest = row[end + nl :]
            start = _find(train.astype(np.int64), rest[:8])
            assert start >= 0 and np.array_equal(train[start : start + len(rest)], rest)
    assert min(lengths) >= 1024 and min(lengths) < 3000 and len(set(lengths)) > 6, lengths
    with pytest.raises(ValueError, match="short_episodes=-0.5"):
        rm.RetrievalMix(tok, train, seq=1024, short_episodes=-0.5)
