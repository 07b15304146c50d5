#!/usr/bin/env bash
# Packs a directory of wheels into parts for the GPU machine, which takes at most 64 MiB a call (tree included).
#
#   bash scripts/pack_wheels.sh WHEEL_DIR OUT_DIR [MIB]     (MIB: the part size, default 56; the tree is ~26 MB)
#
# Each wheel is rewritten with its members stored (the same names, bytes and modes, checked member by member, so
# RECORD holds and pip installs it unchanged), then the whole set is xz-compressed across wheels and split: vLLM
# 0.33's set 939 -> 678 MiB (13 parts of 56 MiB instead of 18 of 54). OUT_DIR gets part.NN, SHA256SUMS and
# install.sh; the same wheels give the same parts (tar with fixed order, times and owners). Over one warm machine,
# every call but the last carries one part and runs
#   mkdir -p /tmp/wheel-parts && cp OUT_DIR/part.* /tmp/wheel-parts/
# and the last carries the last part, install.sh and SHA256SUMS and runs OUT_DIR/install.sh (serving_gpu.sh setup
# does, with WHEELS=OUT_DIR), which checks every part (in ${WHEEL_PARTS:-/tmp/wheel-parts}), names any missing,
# and installs into ${TARGET:-/tmp/site}.
set -euo pipefail
src=${1:?usage: $0 WHEEL_DIR OUT_DIR [MIB]}; out=${2:?usage: $0 WHEEL_DIR OUT_DIR [MIB]}; mib=${3:-56}
ls "$src"/*.whl >/dev/null 2>&1 || { echo "$0: no .whl files in $src" >&2; exit 2; }
stored=$out.stored
rm -rf "$stored" "$out" && mkdir -p "$stored" "$out"
python3 - "$src" "$stored" <<'PY'
import copy, pathlib, shutil, sys, zipfile
src, stored = map(pathlib.Path, sys.argv[1:])
for wheel in sorted(src.glob("*.whl")):
    out = stored / wheel.name
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as b:
        for info in a.infolist():
            entry = copy.copy(info)
            entry.compress_type = zipfile.ZIP_STORED
            with a.open(info) as f, b.open(entry, "w") as g:
                shutil.copyfileobj(f, g, 1 << 24)
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(out) as b:  # the same members, contents and modes
        members = [(i.filename, i.CRC, i.file_size, i.external_attr) for i in a.infolist()]
        assert members == [(i.filename, i.CRC, i.file_size, i.external_attr) for i in b.infolist()], wheel
        assert b.testzip() is None, wheel
PY
tar -C "$stored" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - $(cd "$stored" && ls ./*.whl) | xz -T2 -6 | split -b "${mib}M" -d -a 2 - "$out/part."
rm -rf "$stored"
(cd "$out" && sha256sum part.* > SHA256SUMS)
cat > "$out/install.sh" <<'SH'
#!/usr/bin/env bash
# Checks the parts (carried earlier into /tmp/wheel-parts, or next to this file), joins and unpacks them, and installs
# the wheels into ${TARGET:-/tmp/site} (no index, no dependencies).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); target=${TARGET:-/tmp/site}; parts=${WHEEL_PARTS:-/tmp/wheel-parts}
mkdir -p "$parts"; cp "$here"/part.* "$parts"/ 2>/dev/null || true; cp "$here/SHA256SUMS" "$parts/"
missing=$(cd "$parts" && awk '{print $2}' SHA256SUMS | while read -r f; do [ -f "$f" ] || echo "$f"; done)
[ -z "$missing" ] || { echo "install.sh: parts not on this machine (carry them first):" $missing; exit 1; }
(cd "$parts" && sha256sum --quiet -c SHA256SUMS) || { echo "install.sh: a part is corrupt: carry it again"; exit 1; }
rm -rf /tmp/wheel-bundle && mkdir -p /tmp/wheel-bundle "$target"
unxz() { if command -v xz >/dev/null; then xz -d -T0; else python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)'; fi; }
(cd "$parts" && cat $(awk '{print $2}' SHA256SUMS)) | unxz | tar -xf - -C /tmp/wheel-bundle
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" /tmp/wheel-bundle/*.whl
echo "installed $(ls /tmp/wheel-bundle/*.whl | wc -l) wheels into $target"
SH
chmod +x "$out/install.sh"
n=$(ls "$out"/part.* | wc -l)
echo "$n parts of <= $mib MiB in $out; calls 1..$((n - 1)) carry one part each, call $n carries" \
  "[\"$out/part.$(printf %02d $((n - 1)))\", \"$out/install.sh\", \"$out/SHA256SUMS\"]"
