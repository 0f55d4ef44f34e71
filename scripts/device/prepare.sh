#!/usr/bin/env bash
# Fills .devcarry/ (git-ignored through .git/info/exclude) for a run on the lent GPU machine (the
# `device` tool). That machine has Python 3.12, torch, tokenizers, safetensors, httpx and aiohttp, but
# not Django, Channels, daphne, Celery or Redis, and reaches no registry. Run this here (it downloads
# wheels from PyPI and copies this machine's redis-server with its libraries), then call the device tool
# with carry [".devcarry"] and the command `bash scripts/device/run.sh`. ~58 MB of the 64 MB a call
# may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
rm -rf .devcarry/whl .devcarry/redis
mkdir -p .devcarry/whl .devcarry/redis/lib
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
download() {
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .devcarry/whl "$@"
}
# pyproject.toml's dependencies, less what the machine's image already has (torch above all) and
# psycopg (the benchmarks run on SQLite there). transformers comes alone: the image has its needs.
mapfile -t wanted < <(python3 - <<'PY'
import re, tomllib
on_image = {"torch", "safetensors", "tokenizers", "numpy", "httpx", "aiohttp", "prometheus-client", "psycopg"}
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0].lower()
    if name not in on_image and name != "transformers":
        print(requirement)
PY
)
download "${wanted[@]}"
download --no-deps "$(grep -o '"transformers==[0-9.]*"' pyproject.toml | tr -d '"')"
# The image's own copies of these stay: two versions of one package stop the install.
for name in click python_dateutil narwhals msgpack PyYAML pyyaml typing_extensions packaging attrs idna six \
    aiohttp aiosignal frozenlist multidict yarl propcache aiohappyeyeballs; do
    rm -f .devcarry/whl/"${name}"-*.whl
done
server=$(readlink -f "$(command -v redis-server)")
cp "$server" .devcarry/redis/redis-server
ldd "$server" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s)\.so' \
    | xargs -I{} cp -L {} .devcarry/redis/lib/
du -sh .devcarry
