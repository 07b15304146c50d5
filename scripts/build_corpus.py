"""Rebuild the bundled model's corpus from Debian packages (offline, deterministic).

Sources (Debian bookworm, fetched with ``apt-get download``, unpacked with ``dpkg -x``):

* ``python3.11-doc``: the reStructuredText sources of the Python 3.11 documentation (PSF licence);
* ``debian-reference-en``: the Debian Reference, English HTML (GPL-2+, Osamu Aoki);
* ``debian-handbook``: The Debian Administrator's Handbook, en-US HTML (GPL-2+ or CC-BY-SA-3.0,
  Raphaël Hertzog and Roland Mas);
* ``linux-source-6.1`` (corpus v2, ``--kernel``): the Linux kernel's C sources and headers and its
  ``Documentation/`` reStructuredText (GPL-2.0), read from the package's tarball without unpacking it.
  Long documents with identifiers used far from their definitions: what retrieval needs. Left out:
  files over 200 KB, generated register headers (``asic_reg/``, ``*_sh_mask.h``, ``*_offset.h``) and files
  that are mostly hex tables; then a deterministic share of the rest, by a hash of the path
  (``--kernel-share``).

Each file is one document. Documents are split train / validation / test (90 / 5 / 5) by a hash of
their path, so the split is deterministic and no document straddles two splits.

    python scripts/build_corpus.py --out .data/corpus                      # v1: the documentation
    python scripts/build_corpus.py --out .data/corpus-v2 --kernel --kernel-share 0.4 --package-bytes 700000  # v2
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path

PACKAGES = {
    "python3.11-doc": "PSF-2.0 (Python Software Foundation License), Python documentation authors",
    "debian-reference-en": "GPL-2+ (Osamu Aoki, Debian Reference)",
    "debian-handbook": "GPL-2.0+ or CC-BY-SA-3.0 (Raphael Hertzog and Roland Mas, The Debian Administrator's Handbook)",
}
KERNEL = "linux-source-6.1"
KERNEL_LICENCE = "GPL-2.0 (the Linux kernel; files carry SPDX identifiers, all GPL-2.0-compatible)"
KERNEL_MAX_BYTES = 200_000
_GENERATED = re.compile(r"asic_reg/|_sh_mask\.h$|_offset\.h$|_default\.h$")
_HEX = re.compile(r"0x[0-9a-fA-F]{2,}")
SPLITS = (("train", 90), ("validation", 95), ("test", 100))
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`")
_DIRECTIVE = re.compile(
    r"^\s*\.\. (index|_[^:]*|highlight|module|moduleauthor|sectionauthor|testsetup|testcleanup|currentmodule)::?"
)
_BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "dt", "dd", "table", "section"}


class _HTMLText(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head", "nav"):
            self.skip += 1
        elif tag in _BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head", "nav"):
            self.skip = max(0, self.skip - 1)
        elif tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_to_text(raw: str) -> str:
    p = _HTMLText()
    p.feed(raw)
    return "".join(p.parts)


def rst_to_text(raw: str) -> str:
    lines = [ln for ln in raw.splitlines() if not _DIRECTIVE.match(ln)]
    return _ROLE.sub("`", "\n".join(lines))


def normalise(text: str) -> str:
    lines = [re.sub(r"(?<=\S)[ \t]+", " ", ln).rstrip() for ln in text.splitlines()]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def collect(root: Path) -> list[tuple[str, str, str]]:
    """``(package, relative path, text)`` for every document, sorted by path."""
    docs = []
    py = root / "usr/share/doc/python3.11/html/_sources"
    for f in sorted(py.rglob("*.rst.txt")):
        docs.append(("python3.11-doc", str(f.relative_to(root)), rst_to_text(f.read_text("utf-8"))))
    for f in sorted((root / "usr/share/debian-reference").glob("*.en.html")):
        docs.append(("debian-reference-en", str(f.relative_to(root)), html_to_text(f.read_text("utf-8"))))
    for f in sorted((root / "usr/share/doc/debian-handbook/html/en-US").glob("*.html")):
        docs.append(("debian-handbook", str(f.relative_to(root)), html_to_text(f.read_text("utf-8"))))
    out = []
    for pkg, rel, text in docs:
        text = normalise(text)
        if len(text) >= 200:  # drop near-empty index pages
            out.append((pkg, rel, text))
    return out


def _bucket(rel: str, salt: str = "") -> int:
    return int(hashlib.sha1((salt + rel).encode()).hexdigest(), 16) % 1000


def collect_kernel(root: Path, share: float) -> tuple[list[tuple[str, str, str]], dict]:
    """``(package, path in the tree, text)`` of the kernel's kept files, in tarball order, and what was left
    out (counts). ``share``: the fraction of eligible files kept, chosen by a hash of the path."""
    tarball = next((root / "usr/src").glob("linux-source-*.tar.xz"))
    docs, dropped = [], {"large": 0, "generated": 0, "hex_tables": 0, "short": 0, "not_sampled": 0}
    with tarfile.open(tarball, "r:xz") as tf:
        for m in tf:  # streamed: the tarball is never unpacked
            if not m.isfile() or "/" not in m.name:
                continue
            rel = m.name.split("/", 1)[1]
            code = rel.endswith((".c", ".h"))
            if not (code or (rel.startswith("Documentation/") and rel.endswith(".rst"))):
                continue
            if m.size > KERNEL_MAX_BYTES:
                dropped["large"] += 1
                continue
            if _GENERATED.search(rel):
                dropped["generated"] += 1
                continue
            if _bucket(rel, "kernel") >= share * 1000:
                dropped["not_sampled"] += 1
                continue
            text = tf.extractfile(m).read().decode("utf-8", "replace")
            if len(_HEX.findall(text)) * 40 > len(text):
                dropped["hex_tables"] += 1
                continue
            text = normalise(text if code else rst_to_text(text))
            if len(text) < 200:
                dropped["short"] += 1
                continue
            docs.append((KERNEL, rel, text))
    return docs, dropped


def split_of(rel: str) -> str:
    bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100
    return next(name for name, upper in SPLITS if bucket < upper)


def write_subset(path: Path, texts: list[str], rels: list[str], target: int) -> dict:
    """Documents of one split, taken in the order of a hash of their path until ``target`` bytes, written in
    corpus order: a deterministic sample of every package in the split, small enough to ship."""
    order = sorted(range(len(texts)), key=lambda i: _bucket(rels[i], "package") * 10**6 + i)
    keep, size = set(), 0
    for i in order:
        n = len(texts[i].encode("utf-8")) + 2
        if size + n > target:
            continue
        keep.add(i)
        size += n
    body = "\n\n".join(texts[i] for i in sorted(keep)) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, "utf-8")
    return {"documents": len(keep), "bytes": len(body.encode("utf-8")),
            "sha256": hashlib.sha256(body.encode("utf-8")).hexdigest()}  # fmt: skip


def fetch(workdir: Path, packages) -> dict[str, str]:
    versions = {}
    for pkg in packages:
        subprocess.run(["apt-get", "download", pkg], cwd=workdir, check=True, capture_output=True)
    for deb in sorted(workdir.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(workdir / "root")], check=True)
        name, version = deb.name.split("_")[:2]
        versions[name] = version
    return versions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".data/corpus"))
    ap.add_argument("--unpacked", type=Path, default=None, help="an already unpacked root (skips apt-get)")
    ap.add_argument("--kernel", action="store_true", help=f"corpus v2: add the Linux kernel ({KERNEL})")
    ap.add_argument("--kernel-share", type=float, default=1.0, help="fraction of the eligible kernel files kept")
    ap.add_argument(
        "--package-bytes",
        type=int,
        default=0,
        help="also write package/{validation,test}.txt: a subset of about this many bytes per split "
        "(the text that ships in the wheel)",
    )
    args = ap.parse_args()
    if not 0 < args.kernel_share <= 1:
        raise SystemExit(f"--kernel-share {args.kernel_share}: must be in (0, 1]")
    packages = {**PACKAGES, **({KERNEL: KERNEL_LICENCE} if args.kernel else {})}
    args.out.mkdir(parents=True, exist_ok=True)
    dropped = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.unpacked is None:
            versions = fetch(Path(tmp), packages)
            root = Path(tmp) / "root"
        else:
            versions, root = {}, args.unpacked
        docs = collect(root)
        if args.kernel:
            kernel_docs, dropped = collect_kernel(root, args.kernel_share)
            docs += kernel_docs
    splits: dict[str, list[str]] = {name: [] for name, _ in SPLITS}
    rels: dict[str, list[str]] = {name: [] for name, _ in SPLITS}
    card: dict = {"packages": {p: {"licence": lic, "version": versions.get(p)} for p, lic in packages.items()}}
    if dropped is not None:
        card["kernel_filter"] = {"max_bytes": KERNEL_MAX_BYTES, "share": args.kernel_share, "dropped": dropped}
    per_split: dict[str, dict] = {
        name: {"documents": 0, "bytes": 0, "by_package": {}, "bytes_by_package": {}} for name, _ in SPLITS
    }
    for pkg, rel, text in docs:
        s = split_of(rel)
        splits[s].append(text)
        rels[s].append(rel)
        st = per_split[s]
        st["documents"] += 1
        st["by_package"][pkg] = st["by_package"].get(pkg, 0) + 1
        st["bytes_by_package"][pkg] = st["bytes_by_package"].get(pkg, 0) + len(text.encode("utf-8"))
    for name, texts in splits.items():
        body = "\n\n".join(texts) + "\n"
        (args.out / f"{name}.txt").write_text(body, "utf-8")
        per_split[name]["bytes"] = len(body.encode("utf-8"))
        per_split[name]["sha256"] = hashlib.sha256(body.encode("utf-8")).hexdigest()
    card["splits"] = per_split
    if args.package_bytes > 0:
        card["package_subset"] = {
            name: write_subset(args.out / "package" / f"{name}.txt", splits[name], rels[name], args.package_bytes)
            for name in ("validation", "test")
        }
    (args.out / "corpus.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
