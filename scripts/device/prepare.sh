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
# pyproject.toml's dependencies, less what the machine's image has (torch above all).
download "django>=5.2,<6" "djangorestframework>=3.15" "channels>=4.2" "daphne>=4.1" "celery>=5.4" \
    "plotly>=6" "channels-redis>=4.2" "redis>=5" "drf-spectacular>=0.28" "dj-database-url>=2.3"
download --no-deps "transformers==$(python3 -c 'import re,sys; print(re.search(r"transformers==([\d.]+)", open("pyproject.toml").read())[1])')"
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
