"""Corpus v2's kernel reader on a synthetic kernel tarball: what it keeps, what it leaves out, and that the
choice is deterministic."""

import io
import tarfile
from functools import partial
from pathlib import Path

from script_modules import load_script

_module = partial(load_script, "scripts/build_corpus.py")


def _tree(root: Path, files: dict[str, str]) -> None:
    (root / "usr/src").mkdir(parents=True)
    with tarfile.open(root / "usr/src/linux-source-6.1.tar.xz", "w:xz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"linux-source-6.1/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_the_kernel_reader_keeps_sources_and_docs_and_drops_the_rest(tmp_path):
    bc = _module()
    body = "static int answer(void)\n{\n\treturn  42;\n}\n" * 20
    _tree(tmp_path, {
        "kernel/fork.c": body,
        "include/linux/sched.h": body,
        "Documentation/admin-guide/README.rst": ".. _readme:\n\nThe kernel.\n" + "Some prose about it. " * 20,
        "drivers/gpu/drm/amd/include/asic_reg/gc/gc_9_0_offset.h": body,
        "drivers/net/firmware.h": "static u8 fw[] = {" + "0x1f, " * 400 + "};\n",
        "drivers/huge.c": "x" * (bc.KERNEL_MAX_BYTES + 1),
        "scripts/tool.py": body,
        "lib/tiny.c": "int x;\n",
    })  # fmt: skip
    docs, dropped = bc.collect_kernel(tmp_path, 1.0)
    kept = [rel for _, rel, _ in docs]
    assert kept == ["kernel/fork.c", "include/linux/sched.h", "Documentation/admin-guide/README.rst"]
    assert dropped == {"large": 1, "generated": 1, "hex_tables": 1, "short": 1, "not_sampled": 0}
    assert "return 42;" in docs[0][2] and "\treturn" in docs[0][2]  # inner runs collapsed, indentation kept
    assert ".. _readme:" not in docs[2][2]
    half, dropped_half = bc.collect_kernel(tmp_path, 0.5)
    assert half == bc.collect_kernel(tmp_path, 0.5)[0]  # deterministic
    assert {rel for _, rel, _ in half} <= {rel for _, rel, _ in docs}  # a share of the same files
    assert dropped_half["not_sampled"] > 0


def test_the_shipped_subset_is_deterministic_small_and_in_corpus_order(tmp_path):
    bc = _module()
    texts = [f"doc {i} " + "x" * (100 * (i % 7 + 1)) for i in range(60)]
    rels = [f"dir/file{i}.c" for i in range(60)]
    a = bc.write_subset(tmp_path / "a.txt", texts, rels, 5000)
    b = bc.write_subset(tmp_path / "b.txt", texts, rels, 5000)
    assert a == b and (tmp_path / "a.txt").read_text() == (tmp_path / "b.txt").read_text()
    body = (tmp_path / "a.txt").read_text()
    assert a["bytes"] == len(body.encode()) <= 5000 + 1 and 0 < a["documents"] < 60
    kept = [i for i, t in enumerate(texts) if t in body.rstrip("\n").split("\n\n")]
    assert len(kept) == a["documents"] and body == "\n\n".join(texts[i] for i in kept) + "\n"  # in corpus order
    assert kept != list(range(a["documents"]))  # a hash sample, not the first documents
