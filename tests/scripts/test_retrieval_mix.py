"""The synthetic retrieval rows mixed into model v2's training: exact length, the needles and their answers
where they should be, determinism, and keys disjoint from the NIAH evaluation's."""

from functools import partial

import numpy as np
import pytest

from quantmla.eval import niah
from quantmla.models.loading import builtin_path
from script_modules import load_script

_module = partial(load_script, "scripts/retrieval_mix.py")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("tiny-mla"))


def test_rows_have_the_length_their_needles_and_answers(tok):
    rm = _module()
    train = np.arange(2, 3000, dtype=np.uint16) % 8000 + 2
    mix = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        row = mix.row(rng)
        assert row.shape == (1025,) and row.dtype == np.int64
        text = tok.decode(row.tolist())
        asked = text.split("\nWhat is the special magic number for ")[1:]
        assert asked, "every row asks at least one question"
        for q in asked:
            key = q.split(" mentioned")[0]
            value = q.split("provided text is: ")[1].split(".")[0]
            # the asked needle is stated before the questions, with that value
            assert f"for {key} is: {value}." in text.split("\nWhat is")[0]
    again = rm.RetrievalMix(tok, train, seq=1024, pool=64, seed=1)
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert np.array_equal(mix.row(a), again.row(b))


def test_training_keys_and_templates_match_the_evaluation_but_not_its_keys():
    rm = _module()
    eval_words = {w for k in niah.KEYS for w in k.split("-")}
    assert not eval_words & set(rm.WORDS)
    assert rm._needle("k", "1") == niah._needle("k", "1")
    assert rm._question("k") == niah._question("k")


def test_short_rows_are_refused(tok):
    rm = _module()
    with pytest.raises(ValueError, match="seq=256"):
        rm.RetrievalMix(tok, np.arange(5000, dtype=np.uint16), seq=256)
