"""Needle and question templates for retrieval, split into the ones training may use and the held-out ones.

A retrieval example states ``value`` for ``key`` somewhere in a haystack (the needle) and asks for it at the end
(the question, ending where the value should follow). A model trained on one needle sentence can learn that
sentence rather than retrieval, so the templates form a grammar of several families (statements, key-value lines,
code, JSON records, dialogue) with several phrasings each, and the questions sometimes name the key in other words
(``amber-falcon`` asked as "amber falcon"). Each family has **training** and **held-out** phrasings; the keys come
from two disjoint vocabularies as well. Training rows draw only from :data:`TRAIN`; ``quantmla eval niah`` runs the
held-out ones by default, so a needle score measures retrieval of a sentence the model never saw.

The legacy template (RULER's "One of the special magic numbers for KEY is: VALUE.") belongs to the training set: the
bundled model v2 was trained on it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: template sets ``quantmla eval niah --templates`` takes (``legacy``: RULER's sentence alone, the one the bundled
#: model v2 was trained on, with the keys and draws of the evaluation before the templates: its earlier results)
TEMPLATE_SETS = ("heldout", "train", "all", "legacy")


_KEY_FIELDS = ("{key}", "{key_ident}", "{key_upper}")


@dataclass(frozen=True)
class NeedleTemplate:
    """A needle and its question: ``needle`` formats ``{key}`` and ``{value}``; ``question`` formats ``{key}`` (or
    ``{key_words}``: the key's words without hyphens; ``{key_ident}``: with underscores, for code; ``{key_upper}``: the
    identifier in capitals, for constants) and ends where
    ``lead + VALUE + close`` follows."""

    name: str
    family: str
    split: str  # "train" or "heldout"
    needle: str
    question: str
    close: str = "."
    lead: str = " "

    def __post_init__(self) -> None:
        if self.split not in ("train", "heldout"):
            raise ValueError(f"template {self.name}: split={self.split!r}; valid: train, heldout")
        if "{value}" not in self.needle or not any(k in self.needle for k in _KEY_FIELDS):
            raise ValueError(f"template {self.name}: the needle must name the key and {{value}}")
        if not any(k in self.question for k in (*_KEY_FIELDS, "{key_words}")):
            raise ValueError(f"template {self.name}: the question must name the key")

    def texts(self, key: str, value: str) -> tuple[str, str, str]:
        """``(needle, question, answer)`` for ``key`` and ``value``."""
        ident = key.replace("-", "_")
        names = dict(key=key, key_words=key.replace("-", " "), key_ident=ident, key_upper=ident.upper())
        return (self.needle.format(value=value, **names), self.question.format(**names),
                f"{self.lead}{value}{self.close}")  # fmt: skip


LEGACY = NeedleTemplate(
    "legacy", "statement", "train", " One of the special magic numbers for {key} is: {value}. ",
    "\nWhat is the special magic number for {key} mentioned in the provided text? The special magic number for {key}"
    " mentioned in the provided text is:",
)  # fmt: skip

TEMPLATES: tuple[NeedleTemplate, ...] = (
    LEGACY,
    NeedleTemplate(
        "access-code",
        "statement",
        "train",
        " The access code for {key} is {value}. ",
        "\nWhat is the access code for {key}? The access code for {key} is",
    ),
    NeedleTemplate(
        "remember",
        "statement",
        "train",
        " Please remember that {key} was assigned the number {value}. ",
        "\nWhich number was {key_words} assigned? {key} was assigned the number",
    ),
    NeedleTemplate(
        "kv-colon", "kv", "train", "\n{key}: {value}\n", "\nLook up {key} in the list above.\n{key}:", close=""
    ),
    NeedleTemplate(
        "code-assign",
        "code",
        "train",
        '\n# config\n{key} = "{value}"\n',
        '\n# Which value was set for {key} above?\n{key} = "',
        close='"',
        lead="",
    ),
    NeedleTemplate(
        "json-id",
        "json",
        "train",
        ' {{"name": "{key}", "id": "{value}"}} ',
        '\nWhich id belongs to the record named "{key}"? The record {{"name": "{key}", "id": "',
        close='"',
        lead="",
    ),
    NeedleTemplate(
        "dialogue-number",
        "dialogue",
        "train",
        "\nA: What number did you give {key}?\nB: I gave {key} the number {value}.\n",
        "\nA: Remind me, which number did {key_words} get?\nB: {key} got the number",
    ),
    # held out: phrasings and layouts training never sees
    NeedleTemplate(
        "locker",
        "statement",
        "heldout",
        " Note for later: the locker combination of {key} is {value}. ",
        "\nWhat is the locker combination of {key_words}? The locker combination of {key} is",
    ),
    NeedleTemplate(
        "kv-table",
        "kv",
        "heldout",
        "\n| {key} | {value} |\n",
        "\nIn the table above, which value is in the row of {key}?\n| {key} |",
        close=" |",
    ),
    NeedleTemplate(
        "code-const",
        "code",
        "heldout",
        "\nconst {key} = {value}; // do not change\n",
        "\n// What is the constant {key} set to?\nconst {key} =",
        close=";",
    ),
    NeedleTemplate(
        "json-serial",
        "json",
        "heldout",
        ' {{"device": "{key}", "serial": "{value}"}} ',
        '\nWhat is the serial of the device "{key_words}"? {{"device": "{key}", "serial": "',
        close='"',
        lead="",
    ),
    NeedleTemplate(
        "mail-reference",
        "dialogue",
        "heldout",
        "\nSubject: {key}\nHello, the reference number for this case is {value}. Regards\n",
        "\nWhat reference number did the message about {key} give? The reference number is",
    ),
)

#: key words of the training set (two joined by a hyphen make a key)
TRAIN_WORDS = (
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
#: key words of the evaluation's keys with the training templates (never in training rows)
EVAL_TRAIN_KEYS = ("amber-falcon", "silent-river", "copper-moth", "north-gate", "blue-lantern", "iron-orchid",
                   "quiet-harbor", "paper-tiger", "violet-comet", "stone-garden")  # fmt: skip
#: key words of the held-out set (disjoint from both above)
HELDOUT_WORDS = (
    "atlas", "banjo", "biscuit", "cable", "candle", "castle", "cello", "compass", "cricket", "dragon", "engine",
    "feather", "gopher", "fossil", "galaxy", "goblet", "hammer", "helmet", "island", "kettle", "ladder", "lobster",
    "magnet", "mirror", "mosaic", "needle", "nickel", "oasis", "oracle", "paddle", "parcel", "pillow", "pirate",
    "planet", "pocket", "pulsar", "puzzle", "rocket", "saddle", "sapphire", "signal", "spiral", "sprocket",
    "statue", "temple", "trumpet", "yak", "tunnel", "violin", "voyage", "wagon", "walrus", "whistle", "zebra",
)  # fmt: skip


def templates(which: str) -> tuple[NeedleTemplate, ...]:
    """The templates of set ``which`` (one of :data:`TEMPLATE_SETS`)."""
    if which not in TEMPLATE_SETS:
        raise ValueError(f"templates={which!r}; valid: {', '.join(TEMPLATE_SETS)}")
    if which == "legacy":
        return (LEGACY,)
    return tuple(t for t in TEMPLATES if which == "all" or t.split == which)


def eval_key(split: str, rng: random.Random, taken: set[str] = frozenset()) -> str:
    """An evaluation key for a template of ``split``: one of :data:`EVAL_TRAIN_KEYS` for the training templates, two
    held-out words for the held-out ones; never one of ``taken``."""
    for _ in range(1000):
        if split == "train":
            key = rng.choice(EVAL_TRAIN_KEYS)
        else:
            a, b = rng.sample(HELDOUT_WORDS, 2)
            key = f"{a}-{b}"
        if key not in taken:
            return key
    raise ValueError(f"no key left outside {sorted(taken)}")


def train_key(rng) -> str:
    """A training key: two distinct words of :data:`TRAIN_WORDS` (``rng``: numpy Generator or random.Random)."""
    a, b = _two(rng, len(TRAIN_WORDS))
    return f"{TRAIN_WORDS[a]}-{TRAIN_WORDS[b]}"


def _two(rng, n: int) -> tuple[int, int]:
    if isinstance(rng, random.Random):
        a, b = rng.sample(range(n), 2)
        return a, b
    a, b = rng.choice(n, size=2, replace=False)
    return int(a), int(b)
