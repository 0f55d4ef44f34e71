#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/device/prepare.sh filled .devcarry here:
#   device run: command `bash scripts/device/run.sh`, carry [".devcarry"], timeout_s 600
# Where one engine step's time goes on the GPU, then the data-plane comparison on both layers. Each
# benchmark has its own time limit, so one that hangs costs only its share; the whole fits in ~8 min.
# Results: stdout (the key lines) and $OUT/results.tgz (every report and the platforms' logs).
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
collect() {
    for d in /tmp/switchyard-bench-*; do
        for f in "$d"/*.log; do [ -f "$f" ] && cp "$f" "$work/$(basename "$d")-$(basename "$f")"; done
    done
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$work" .
}
trap collect EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .devcarry/whl/*.whl > "$work/pip.log" 2>&1 || { echo "pip failed"; tail -20 "$work/pip.log"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"
LD_LIBRARY_PATH=.devcarry/redis/lib .devcarry/redis/redis-server --port 6379 --save '' --appendonly no \
    --daemonize yes > /dev/null || echo "redis-server did not start: the redis rows will fail"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

echo "=== step profile"
timeout 90 python3 -m serving.benchmarks.step_profile --batch 1 64 2>&1 | grep -v "^USDT" | tee "$work/step.txt"
bench() {  # name, args...
    local name=$1
    shift
    echo "=== $name: $*"
    timeout 150 python3 manage.py bench serve --compare "$@" > "$work/$name.txt" 2> "$work/$name.err"
    echo "rc=$?"
    grep -E "p50_ttft|p50_tpot|output_tok|kept|added|outside|refusals|statuses" "$work/$name.txt"
}
for layer in embedded redis; do
    bench "$layer-saturation" --layer "$layer" --num-requests 64 --quota-flood 10
    for seed in 1 2; do
        bench "$layer-light-$seed" --layer "$layer" --rate 8 --num-requests 120 --output-len 8-16 --seed "$seed"
    done
done
echo "done"
