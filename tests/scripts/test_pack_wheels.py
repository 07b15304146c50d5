"""``scripts/pack_wheels.sh``: the wheels for the GPU machine, stored, xz-compressed across wheels and split into
parts; its ``install.sh`` names missing or corrupt parts and installs wheels whose members are the originals'."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="packing needs the xz command")


def _wheel(directory: Path, name: str, files: dict[str, tuple[bytes, int]]) -> Path:
    """A minimal valid wheel (py3-none-any) with ``files``: path -> (bytes, unix mode)."""
    dist = f"{name}-1.0.dist-info"
    path = directory / f"{name}-1.0-py3-none-any.whl"
    members = dict(files)
    members[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(), 0o644)
    wheel = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    members[f"{dist}/WHEEL"] = (wheel, 0o644)
    members[f"{dist}/RECORD"] = (b"", 0o644)  # pip accepts a RECORD without hashes
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, (data, mode) in members.items():
            info = zipfile.ZipInfo(member, date_time=(2026, 12, 7, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


def _run(args, env=None, cwd=ROOT):
    return subprocess.run(args, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)


def test_parts_install_the_original_members_and_refuse_a_missing_or_corrupt_part(tmp_path):
    src, out, parts, site = tmp_path / "wheels", tmp_path / "out", tmp_path / "parts", tmp_path / "site"
    src.mkdir()
    payload = os.urandom(3 << 20)  # incompressible: 3 MiB gives several parts of 1 MiB
    _wheel(src, "alpha", {"alpha/__init__.py": (b"X = 1\n" * 1000, 0o644), "alpha/blob.bin": (payload, 0o644)})
    _wheel(src, "beta", {"beta/__init__.py": (b"", 0o644), "beta/bin/tool": (b"#!/bin/sh\necho hi\n", 0o755)})
    done = _run(["bash", "scripts/pack_wheels.sh", str(src), str(out), "1"])
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.glob("part.*"))
    assert len(names) >= 3 and names[0] == "part.00"
    assert (out / "install.sh").exists() and (out / "SHA256SUMS").read_text().count("part.") == len(names)
    assert not (tmp_path / "out.stored").exists()

    env = {"WHEEL_PARTS": str(parts), "TARGET": str(site)}
    # every part but the last carried earlier, the last beside install.sh: a missing part is named
    parts.mkdir()
    for name in names[1:-1]:
        shutil.copy(out / name, parts / name)
    carried = tmp_path / "carried"
    carried.mkdir()
    for name in (names[-1], "install.sh", "SHA256SUMS"):
        shutil.copy(out / name, carried / name)
    missing = _run(["bash", str(carried / "install.sh")], env)
    assert missing.returncode == 1 and "part.00" in missing.stdout and not site.exists()
    # a corrupt part is refused
    (parts / "part.00").write_bytes(b"not the part")
    corrupt = _run(["bash", str(carried / "install.sh")], env)
    assert corrupt.returncode == 1 and "corrupt" in corrupt.stdout
    shutil.copy(out / "part.00", parts / "part.00")
    done = _run(["bash", str(carried / "install.sh")], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installed 2 wheels" in done.stdout
    assert (site / "alpha" / "blob.bin").read_bytes() == payload
    assert (site / "alpha" / "__init__.py").read_bytes() == b"X = 1\n" * 1000
    assert os.access(site / "beta" / "bin" / "tool", os.X_OK)  # the executable's mode survives
    assert _run([sys.executable, "-c", "import alpha; print(alpha.X)"], {"PYTHONPATH": str(site)}).stdout == "1\n"


def test_no_wheels_is_one_line_before_any_work(tmp_path):
    done = _run(["bash", "scripts/pack_wheels.sh", str(tmp_path), str(tmp_path / "out")])
    assert done.returncode == 2 and done.stderr.strip().endswith(f"no .whl files in {tmp_path}")
    assert not (tmp_path / "out").exists()
