"""Needle-in-a-haystack retrieval through the quantised cache (RULER's S-NIAH style), offline.

Every example is generated from a seed: a haystack of ``length`` tokens with one needle at a relative ``depth``,
then the question, both from a template of :mod:`quantmla.eval.needles`: by default the **held-out** ones, phrasings
and keys no training row uses (``templates="train"``: the ones training may use, among them RULER's "One of the
special magic numbers for KEY is: VALUE."; ``"all"``: both).
Tasks:

* ``niah-1``: a repeated-noise haystack, numeric value;
* ``niah-2``: a corpus-text haystack (the bundled test split by default), numeric value;
* ``niah-3``: a corpus haystack, UUID-like value;
* ``niah-mk``: like ``niah-2`` with three needles of different keys; one is asked.

The answer is generated greedily through :class:`~quantmla.cache.QuantizedLatentCache` as decode
sees it: the prompt but its last token is prefilled into the cache, then the last prompt token and
every answer token are decode steps, so even the first answer token attends the stored (quantised)
cache, with the sink and recent windows unquantised. An example counts as retrieved when the
generated text contains the value (exact match of the value string).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm.auto import tqdm

from quantmla.eval.needles import EVAL_TRAIN_KEYS, LEGACY, eval_key
from quantmla.eval.needles import templates as needle_templates
from quantmla.formats.codec import ModelCodec, scheme_name
from quantmla.measure.progress import layer_postfix

TASKS = ("niah-1", "niah-2", "niah-3", "niah-mk")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: the keys asked with the training templates (``quantmla.eval.needles``)
KEYS = EVAL_TRAIN_KEYS


@dataclass(frozen=True)
class NiahConfig:
    """What to run: tasks x lengths (tokens) x depths (percent), ``num_examples`` per cell."""

    tasks: tuple[str, ...] = ("niah-1", "niah-2", "niah-3")
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    depths: tuple[int, ...] = (0, 25, 50, 75, 100)
    num_examples: int = 2
    #: greedy answer tokens beyond the value's own (the value's token count differs by tokenizer and value)
    new_tokens: int = 4
    seed: int = 0
    group_size: int = 64
    sink: int = 4
    recent: int = 128
    templates: str = "heldout"  # which needle templates: heldout, train, all or legacy (quantmla.eval.needles)

    def __post_init__(self) -> None:
        needle_templates(self.templates)
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"NIAH tasks {list(bad) or 'none'}; valid: {', '.join(TASKS)}")
        if not self.lengths or min(self.lengths) < 128:
            raise ValueError(f"lengths {list(self.lengths)}: give at least one, each >= 128 tokens")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"depths {list(self.depths)}: give at least one, each a percent in 0..100")
        for name in ("num_examples", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")


@dataclass(frozen=True)
class Example:
    task: str
    length: int
    depth: int
    index: int
    template: str
    split: str  # the template's set: train or heldout
    prompt_ids: list[int] = field(repr=False)
    value: str
    needle_token: int  # where the asked needle starts in the prompt (token index)
    value_tokens: int  # tokens of " VALUE." (the answer as the needle states it)
    haystack_tokens: int  # the prompt's haystack tokens (without needles and question)


def _value(task: str, rng: random.Random) -> str:
    if task == "niah-3":
        h = "".join(rng.choice("0123456789abcdef") for _ in range(12))
        return f"{h[:4]}-{h[4:8]}-{h[8:]}"
    return str(rng.randrange(1_000_000, 10_000_000))


def make_example(tokenizer, corpus_ids: list[int], noise_ids: list[int], task: str, length: int, depth: int,
                 index: int, seed: int, templates: str = "heldout") -> Example:  # fmt: skip
    """One example of exactly ``length`` prompt tokens, deterministic in its arguments."""
    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{index}")
    count = 3 if task == "niah-mk" else 1
    if templates == "legacy":  # the draws of the evaluation before the templates: its prompts, token for token
        template, keys = LEGACY, rng.sample(KEYS, count)
    else:
        template = rng.choice(needle_templates(templates))
        keys = []
        for _ in range(count):
            keys.append(eval_key(template.split, rng, set(keys)))
    values = [_value(task, rng) for _ in keys]
    asked = rng.randrange(len(keys))
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    texts = [template.texts(k, v) for k, v in zip(keys, values, strict=True)]
    needles = [enc(t[0]) for t in texts]
    question = enc(texts[asked][1])
    room = length - len(question) - sum(map(len, needles))
    if room < 16:
        raise ValueError(f"length {length} leaves no room for a haystack; use a longer length")
    if task == "niah-1":
        hay = (noise_ids * (room // len(noise_ids) + 1))[:room]
    else:
        start = rng.randrange(max(1, len(corpus_ids) - room))
        hay = (corpus_ids * (room // max(1, len(corpus_ids)) + 1))[start : start + room]
    # the asked needle at `depth` percent of the haystack, the others at random places
    spots = [round(room * depth / 100)] + [rng.randrange(room + 1) for _ in keys[1:]]
    order = [asked] + [i for i in range(len(keys)) if i != asked]
    inserts = sorted(zip(spots, order, strict=True), key=lambda so: (so[0], so[1] != asked))
    ids, prev, where = [], 0, 0
    for spot, i in inserts:
        ids += hay[prev:spot]
        if i == asked:
            where = len(ids)
        ids += needles[i]
        prev = spot
    ids += hay[prev:] + question
    assert len(ids) == length, (len(ids), length)
    return Example(task, length, depth, index, template.name, template.split, ids, values[asked], where,
                   len(enc(texts[asked][2])), room)  # fmt: skip


def examples(tokenizer, corpus: str, cfg: NiahConfig) -> list[Example]:
    """Every example of the configuration, in (task, length, depth, index) order."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    corpus_ids = enc(corpus[:400_000])
    noise_ids = enc(NOISE)
    return [make_example(tokenizer, corpus_ids, noise_ids, t, n, d, i, cfg.seed, cfg.templates)
            for t in cfg.tasks for n in cfg.lengths for d in cfg.depths for i in range(cfg.num_examples)]  # fmt: skip


@torch.no_grad()
def answer(model, prompt: torch.Tensor, scheme: str | ModelCodec, cfg: NiahConfig, value_tokens: int = 0) -> list[int]:
    """``value_tokens + cfg.new_tokens`` greedy answer tokens of ``prompt [1, T]`` through the cache as decode
    sees it."""
    from quantmla.cache import QuantizedLatentCache
    from quantmla.models.compat import cache_kwargs
    from quantmla.models.latent import enable_latent_attention, is_latent_attention_enabled

    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)
    cache = QuantizedLatentCache(model.config, scheme=scheme, group_size=cfg.group_size, sink=cfg.sink,
                                 recent=cfg.recent)  # fmt: skip
    cache.declare_latent_reader()  # the decode steps below run under latent attention (the kernel on CUDA)
    # the prefill: latent attention computes its many queries in the expanded form (no L x L score matrices)
    model(input_ids=prompt[:, :-1], use_cache=True, **cache_kwargs(cache))
    tok, out = prompt[:, -1:], []
    for _ in range(value_tokens + cfg.new_tokens):
        logits = model(input_ids=tok, use_cache=True, **cache_kwargs(cache)).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        out.append(int(tok))
    return out


@dataclass
class NiahRow:
    scheme: str
    task: str
    length: int
    depth: int
    index: int
    value: str
    output: str
    correct: bool
    template: str = ""  # the needle template (quantmla.eval.needles) and its set
    split: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def run_niah(
    model,
    tokenizer,
    corpus: str,
    schemes: list[str | ModelCodec],
    cfg: NiahConfig,
    progress: bool = True,
    exs: list[Example] | None = None,
) -> list[NiahRow]:
    """Every example under every scheme; one row each (``exs``: :func:`examples` made already). Latent attention is
    enabled on ``model`` (in place), so on CUDA in BF16 the answers decode through the fused kernel, as a deployment
    would (:func:`answer`)."""
    exs = examples(tokenizer, corpus, cfg) if exs is None else exs
    dev = next(model.parameters()).device
    rows = []
    with (
        tqdm(total=len(exs) * len(schemes), desc="NIAH", unit="example", disable=not progress) as bar,
        layer_postfix(model, bar),
    ):
        for scheme in schemes:
            for ex in exs:
                ids = torch.tensor([ex.prompt_ids], device=dev)
                text = tokenizer.decode(answer(model, ids, scheme, cfg, ex.value_tokens))
                row = NiahRow(scheme_name(scheme), ex.task, ex.length, ex.depth, ex.index, ex.value, text,
                              ex.value in text, ex.template, ex.split)  # fmt: skip
                rows.append(row)
                bar.update()
    return rows


def _select(rows: list[NiahRow], where: dict) -> list[NiahRow]:
    sel = [r for r in rows if all(getattr(r, k) == v for k, v in where.items())]
    if not sel:
        raise ValueError(f"no NIAH rows for {where}")
    return sel


def accuracy(rows: list[NiahRow], **where) -> float:
    """Exact-match accuracy of the rows matching ``where`` (e.g. ``scheme="c4r4", length=4096``)."""
    sel = _select(rows, where)
    return sum(r.correct for r in sel) / len(sel)


def tally(rows: list[NiahRow], by: str, **where) -> dict[int | str, tuple[int, int]]:
    """``{value of by: (correct, total)}`` over the rows matching ``where``, in ascending order of ``by`` (e.g.
    ``tally(rows, "depth", scheme="bf16")``: the per-depth counts a target such as "17 of 18 at every depth"
    reads)."""
    names = [f.name for f in fields(NiahRow)]
    if by not in names:
        raise ValueError(f"by={by!r}; valid: {', '.join(names)}")
    counts: dict[int | str, tuple[int, int]] = {}
    for r in _select(rows, where):
        correct, total = counts.get(getattr(r, by), (0, 0))
        counts[getattr(r, by)] = (correct + r.correct, total + 1)
    return dict(sorted(counts.items()))


def heatmap(rows: list[NiahRow], scheme: str, path) -> None:
    """Accuracy over length x depth for ``scheme``, one panel per task (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in rows if r.scheme == scheme})
    lengths = sorted({r.length for r in rows})
    depths = sorted({r.depth for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks) + 1.2, 3.4), squeeze=False, layout="constrained")
    for ax, task in zip(axes[0], tasks, strict=True):
        grid = [[accuracy(rows, scheme=scheme, task=task, length=n, depth=d) for d in depths] for n in lengths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_title(task)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("context tokens")
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03)
    splits = sorted({r.split for r in rows if r.scheme == scheme})
    fig.suptitle(f"NIAH exact match, {scheme}, templates: {' + '.join(splits)}")
    fig.savefig(path, dpi=110, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
