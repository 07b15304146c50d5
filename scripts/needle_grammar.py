"""A grammar of training needle templates: many phrasings per family, none of them held out.

The evaluation's held-out templates (:mod:`quantmla.eval.needles`) test whether a model retrieves a needle it was never
shown the wording of. Seven fixed training phrasings teach seven sentences; this grammar composes thousands from parts:
a family (statement, key-value line, code, JSON record, dialogue or note, or a record whose header line names the key
and whose body states the value), a relation noun, a frame for the needle, a
question intro and an answer cue. About half the cues repeat the needle's words before the value (a copy cue, as
"kv-colon" and the held-out "kv-table" are); the rest ask in other words ("Answer:", "It is"), so the model has to find
the needle by its key, not by its wording. Given family weights (``--retrieval-families``), a seventh family, ``memo``,
composes such records from parts (a header naming the key, an optional line, an opener, a body sentence stating the
value, a sign-off) and asks in other words, and an eighth, ``delimited``, writes rows of fields between
delimiters; without weights the six families are drawn uniformly, as before these existed.

Nothing here may produce a held-out template: the relation nouns, field names and frames leave out the held-out
templates' words and layouts (locker combinations, table rows, ``const`` declarations, device serials, mail subjects
and reference numbers); a test checks every piece of held-out text against a sample of generated templates.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from quantmla.eval.needles import NeedleTemplate

#: the grammar's families (``record``: the key on a header line, the value in a sentence below it), drawn uniformly
FAMILIES = ("statement", "kv", "code", "json", "dialogue", "record")
#: families drawn only when weights are given: ``memo``, composed records (a header line naming the key, an optional
#: line between, a body sentence stating the value; the question names the key in other words and its cue does not
#: repeat the body's words before the value); ``delimited``, rows of fields between delimiters (the key, the value,
#: sometimes a third field), asked mostly with the row's start as the cue, so the answer ends at the next delimiter
WEIGHTED_FAMILIES = (*FAMILIES, "memo", "delimited")
#: relation nouns of the statement, dialogue and note families (none of the held-out templates' nouns)
RELATIONS = (
    "access code", "passcode", "PIN", "ticket number", "order number", "account number", "room number",
    "tracking code", "badge number", "license key", "phone extension", "build tag", "batch number", "voucher code",
    "seat number", "vault code", "secret word", "API token", "member id", "invoice number", "flight number",
    "port number", "customer id", "product code", "pass number", "parcel code", "gate code", "permit number",
)  # fmt: skip
#: (key field, value field) of the JSON family (the held-out record is a device and its serial)
FIELDS = (("name", "id"), ("user", "token"), ("host", "port"), ("item", "sku"), ("account", "pin"), ("title", "code"),
          ("label", "number"), ("city", "zip"), ("project", "budget"), ("team", "score"))  # fmt: skip

# statement needles: the part before the value is the copy cue
_STATEMENT = (
    " The {rel} of {key} is {value}. ",
    " The {rel} for {key} is {value}. ",
    " It was agreed that the {rel} of {key} would be {value}. ",
    " For the record, {key} has the {rel} {value}. ",
    " Keep this in mind: the {rel} assigned to {key} is {value}. ",
    " Update: {key} now uses {rel} {value}. ",
)
_ASK = (
    "\nWhat is the {rel} of {kq}?",
    "\nWhich {rel} does {kq} have?",
    "\nDo you remember the {rel} of {kq}?",
    "\nTell me the {rel} given for {kq}.",
    "\nQuestion: what {rel} was mentioned for {kq}?",
)
_OTHER_CUE = (" Answer:", " It is", " The answer is", "\nAnswer:", " The {rel} is")

_KV = ("\n{key}: {value}\n", "\n{key} = {value}\n", "\n{key} -> {value}\n", "\n- {key}: {value}\n",
       "\n{key}, {value}\n", "\n* {key} => {value}\n", "\n[{key}] {value}\n", "\n{key}\t{value}\n",
       "\n{key} ........ {value}\n", "\n({key}) {value}\n", "\n<{key}> {value}\n", "\n{key} ~ {value}\n")  # fmt: skip
_KV_ASK = ("\nLook up {kq} in the list above.", "\nFind the entry for {kq}.", "\nWhat was listed for {kq}?",
           "\nThe line for {kq} reads:")  # fmt: skip

_CODE = (
    ('\n{ki} = "{value}"\n', '\n# What is {ki} set to above?\n{ki} = "', '"', ""),
    ('\nexport {KI}="{value}"\n', '\n# print the {KI} exported above\nexport {KI}="', '"', ""),
    ("\n#define {KI} {value}\n", "\n/* the value of {KI} defined above */\n#define {KI}", "", " "),
    ('\nlet {ki} = "{value}";\n', '\n// which string is {ki}?\nlet {ki} = "', '";', ""),
    ('\n    "{key}": "{value}",\n', '\n# the entry for "{key}" in the dict above\n    "{key}": "', '",', ""),
    ("\nset {ki} to {value}\n", "\n-- what was {ki} set to? set {ki} to", "", " "),
)

_DIALOGUE = (
    ("\nA: What {rel} did you give {key}?\nB: I gave {key} the {rel} {value}.\n",
     "\nA: Which {rel} did {kq} get again?\nB: {key} got the {rel}"),
    ("\nCustomer: My {rel} for {key} is {value}.\nAgent: Thank you.\n",
     "\nAgent: Could you repeat the {rel} for {kq}?\nCustomer: Sure, it is"),
    ("\nDear team, the {rel} we use for {key} is {value}. Best wishes\n",
     "\nWhich {rel} did the note give for {kq}? The note gave"),
    ("\nNOTE ({key}): {rel} = {value}\n", "\nWhat did the note about {kq} say the {rel} was? It said"),
)  # fmt: skip


# records: the key on a header line, the value in a later sentence (found by the key, not by the words before it)
_RECORD = (
    ("\nTicket: {key}\nStatus: open. The {rel} on file is {value}.\n",
     "\nWhat {rel} is on file for the ticket {kq}? The {rel} is"),
    ("\nProfile {key}\nCreated last week; its {rel} is {value}.\n",
     "\nWhat is the {rel} in the profile of {kq}? Its {rel} is"),
    ("\n== {key} ==\nAfter the review the {rel} became {value}.\n",
     "\nWhat did the {rel} of the section {kq} become? It became"),
    ("\nFrom: {key}\nThanks, my {rel} is {value}. Cheers\n",
     "\nWhich {rel} did {kq} send? The {rel} sent was"),
    ("\nEntry {key} (updated)\nThe {rel} recorded here: {value}\n",
     "\nWhich {rel} was recorded in the entry {kq}? Recorded:"),
    ("\n### {key}\nPlease use {value} as the {rel}.\n",
     "\nUnder the heading {kq}, which {rel} should be used? Use"),
)  # fmt: skip


# memo parts (none of the held-out e-mail's words: no subject line, greeting, sign-off or reference number)
_MEMO_HEAD = ("Re: {key}", "Topic: {key}", "[{key}]", "File {key}", "Order {key}", "To: {key}", "Item: {key}",
              "Thread {key}", "{key}:", "Name: {key}", "About {key}", "Title: {key}", "Log {key}",
              "Project {key}")  # fmt: skip
_MEMO_MID = ("", "", "\nStatus: done.", "\n(updated)", "\nPriority: low.", "\nSee below.")
_MEMO_OPEN = ("", "Hi, ", "Note: ", "Dear all, ", "FYI, ", "Thanks. ", "Good news: ", "Quick update: ")
_MEMO_BODY = ("the {rel} on record is {value}.", "its {rel} is {value}.", "we set the {rel} to {value}.",
              "the {rel} you asked for is {value}.", "please note the {rel}: {value}.", "{rel} confirmed as {value}.",
              "the assigned {rel} is {value}.", "we now use {value} as the {rel}.")  # fmt: skip
_MEMO_CLOSE = ("", " Thanks", " Best", " Cheers", " See you")
_MEMO_ASK = ("\nWhat {rel} did the note about {kq} give?", "\nWhich {rel} was given under {kq}?",
             "\nWhat is the {rel} in the entry for {kq}?", "\nWhat {rel} was sent for {kq}?",
             "\nFor {kq}, what {rel} was stated?", "\nWhat {rel} goes with {kq}?")  # fmt: skip
_MEMO_CUE = (" The {rel} is", " The {rel} was", " Answer:", " It was", " The {rel} given was", " It is")


def _memo(rng: np.random.Generator, rel: str, kq: str) -> tuple[str, str]:
    """A composed record: ``(needle, question)``."""
    head, mid, opener = _pick(rng, _MEMO_HEAD), _pick(rng, _MEMO_MID), _pick(rng, _MEMO_OPEN)
    body, close = _pick(rng, _MEMO_BODY).replace("{rel}", rel), _pick(rng, _MEMO_CLOSE)
    if not opener:
        body = body[0].upper() + body[1:]
    ask = _pick(rng, _MEMO_ASK).format(rel=rel, kq=kq) + _pick(rng, _MEMO_CUE).format(rel=rel)
    return f"\n{head}{mid}\n{opener}{body}{close}\n", ask


# delimited rows (no "|": the held-out table's delimiter)
_DELIMS = ("/", "#", "+", ";", "~", "!", "::", "*", "^", "%", "=>", "<>")
_DELIM_EXTRA = ("", "", "ok", "done", "new", "2024", "x")
_DELIM_ASK = ("\nWhich entry above belongs to {kq}?", "\nWhat is written next to {kq} above?",
              "\nFind {kq} in the rows above.", "\nRead the line of {kq} again:",
              "\nCopy the row for {kq}:")  # fmt: skip


def _delimited(rng: np.random.Generator, kq: str, copy: bool) -> tuple[str, str, str, str]:
    """A delimited row: ``(needle, question, close, lead)``."""
    d, extra = _pick(rng, _DELIMS), _pick(rng, _DELIM_EXTRA)
    start = f"{d} " if rng.random() < 0.7 else ""
    tail = f" {d} {extra} {d}" if extra else f" {d}"
    needle = f"\n{start}{{key}} {d} {{value}}{tail}\n"
    if copy:
        return needle, _pick(rng, _DELIM_ASK).format(kq=kq) + f"\n{start}{{key}} {d}", f" {d}", " "
    return needle, _pick(rng, _DELIM_ASK[:3]).format(kq=kq) + " Answer:", "", " "


def _family(rng: np.random.Generator, weights: Mapping[str, float] | None) -> str:
    """The family: uniform over :data:`FAMILIES` (the draw of runs made before weights existed), or by ``weights``
    over :data:`WEIGHTED_FAMILIES` (a family not named has weight 0)."""
    if weights is None:
        return _pick(rng, FAMILIES)
    check_weights(weights)
    p = np.asarray([float(weights.get(f, 0.0)) for f in WEIGHTED_FAMILIES])
    return WEIGHTED_FAMILIES[int(rng.choice(len(p), p=p / p.sum()))]


def check_weights(weights: Mapping[str, float]) -> None:
    """Refuse unknown families, negative weights and an all-zero draw (one line naming the bad value)."""
    unknown = sorted(set(weights) - set(WEIGHTED_FAMILIES))
    if unknown:
        raise ValueError(f"family weights: unknown {', '.join(unknown)}; valid: {', '.join(WEIGHTED_FAMILIES)}")
    bad = {f: w for f, w in weights.items() if not w >= 0.0}
    if bad or not sum(weights.values()) > 0:
        raise ValueError(f"family weights {dict(weights)}: each >= 0 and their sum > 0")


def parse_weights(text: str) -> dict[str, float]:
    """``"memo=3,record=2,kv=1"`` -> a checked mapping (families not named get weight 0)."""
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value) if sep else float("")
        except ValueError:
            raise ValueError(f"family weights: {part!r} is not FAMILY=NUMBER; valid families: "
                             f"{', '.join(WEIGHTED_FAMILIES)}") from None  # fmt: skip
    check_weights(out)
    return out


def _key_form(rng: np.random.Generator) -> str:
    """How the question names the key: as written, in words, or as an identifier."""
    return ("{key}", "{key_words}", "{key_ident}")[int(rng.choice(3, p=(0.5, 0.3, 0.2)))]


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(0, len(options)))]


def generate(rng: np.random.Generator, index: int = 0, weights: Mapping[str, float] | None = None) -> NeedleTemplate:
    """One training template composed from the grammar (deterministic in ``rng``); ``weights``: the families' relative
    frequencies (checked by :func:`check_weights`; ``None``: uniform over :data:`FAMILIES`, the earlier runs' draw)."""
    family = _family(rng, weights)
    rel = _pick(rng, RELATIONS)
    kq = _key_form(rng)
    copy = rng.random() < 0.5
    name = f"gen-{family}-{index}"
    if family == "statement":
        frame = _pick(rng, _STATEMENT).replace("{rel}", rel)
        ask = _pick(rng, _ASK).format(rel=rel, kq=kq)
        cue = " " + frame.split("{value}")[0].strip() if copy else _pick(rng, _OTHER_CUE).format(rel=rel)
        return NeedleTemplate(name, family, "train", frame, ask + cue)
    if family == "kv":
        frame = _pick(rng, _KV)
        before = frame.split("{value}")[0]
        lead = " " if before.endswith(" ") else ""
        ask = _pick(rng, _KV_ASK).format(kq=kq)
        cue = before.rstrip(" ") if copy else "\nAnswer:"
        return NeedleTemplate(name, family, "train", frame, ask + cue, close="", lead=lead if copy else " ")
    if family == "code":
        needle, question, close, lead = _pick(rng, _CODE)
        names = {"ki": "{key_ident}", "KI": "{key_upper}"}
        needle, question = needle.format(value="{value}", key="{key}", **names), question.format(key="{key}", **names)
        return NeedleTemplate(name, family, "train", needle, question, close=close, lead=lead)
    if family == "json":
        kf, vf = _pick(rng, FIELDS)
        needle = ' {{"' + kf + '": "{key}", "' + vf + '": "{value}"}} '
        if copy:
            question = f'\nWhich {vf} belongs to the {kf} "{kq}"? ' + '{{"' + kf + '": "{key}", "' + vf + '": "'
            return NeedleTemplate(name, family, "train", needle, question, close='"', lead="")
        question = f'\nWhat is the {vf} of the {kf} "{kq}"? Answer:'
        return NeedleTemplate(name, family, "train", needle, question, close="", lead=" ")
    if family == "memo":
        needle, question = _memo(rng, rel, kq)
        return NeedleTemplate(name, family, "train", needle, question)
    if family == "delimited":
        needle, question, close, lead = _delimited(rng, kq, rng.random() < 0.8)
        return NeedleTemplate(name, family, "train", needle, question, close=close, lead=lead)
    needle, question = _pick(rng, _DIALOGUE if family == "dialogue" else _RECORD)
    question = question.format(rel=rel, kq=kq, key="{key}")
    return NeedleTemplate(name, family, "train", needle.replace("{rel}", rel), question)
