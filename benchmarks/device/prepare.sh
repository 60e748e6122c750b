#!/usr/bin/env bash
# Here, before a session's first call to a lent GPU machine: fill .device-kit/ (git-ignored
# through .git/info/exclude) with what that machine lacks for carpool's GPU checks. It has
# Python 3.12 and its own CUDA torch, numpy, transformers and most of carpool's needs
# (the device tool's KINDS.md lists them), reaches no package index, and each call carries
# at most 64 MiB. So: cp312 wheels of the rest, at requirements.lock's versions, resolved
# with their dependencies, less what must stay the machine's own (torch and the packages
# built against it); and Debian's wrk with its LuaJIT for the HTTP load.
#
#     benchmarks/device/prepare.sh        then run.sh there (its header says how)
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.device-kit
TOP=(httptools orjson pydantic pytest pytest-asyncio pytest-timeout pytest-xdist openai grpcio protobuf
     typer uvloop prometheus-client)
# the lock's tritonclient pins a geventhttpclient with no cp312 wheel: the newest that has
LOOSE=("tritonclient[http,grpc]")
# the machine's own: CUDA torch and what is built against it or is large and there already
KEEP='^(torch|triton|nvidia|numpy|ml_dtypes|aiohttp|frozenlist|multidict|yarl|propcache|aiosignal|aiohappyeyeballs|attrs|setuptools)[-_]'
rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/debs"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx "/$KIT/" "$exclude" 2>/dev/null || echo "/$KIT/" >>"$exclude"
download() {  # into $1, the rest pip's arguments
    local into=$1
    shift
    python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        -d "$into" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
download "$KIT/wheels" --constraint requirements.lock "${TOP[@]}"
download "$KIT/loose" "${LOOSE[@]}"
# one version of each package (two stop the whole install there): the lock's first
name_of() { echo "${1%%-[0-9]*}" | tr 'A-Z-' 'a-z_'; }
for wheel in "$KIT"/loose/*.whl; do
    name=$(name_of "$(basename "$wheel")")
    found=false
    for have in "$KIT"/wheels/*.whl; do
        [ "$(name_of "$(basename "$have")")" = "$name" ] && found=true && break
    done
    $found || mv "$wheel" "$KIT/wheels/"
done
rm -rf "$KIT/loose"
find "$KIT/wheels" -maxdepth 1 -name '*.whl' -printf '%f\n' | { grep -E "$KEEP" || true; } |
    while read -r wheel; do rm "$KIT/wheels/$wheel"; done
(cd "$KIT/debs" && apt-get download wrk 'libluajit-5.1-2' >/dev/null)
echo "$KIT: $(find "$KIT" -type f | wc -l) files, $(du -sh "$KIT" | cut -f1) (a call carries 64 MiB with the tree)"
