#!/usr/bin/env bash
# One prepared GPU check: no network.  Usage: bash tools/device_check.sh OUT_DIR
# Expects torch with CUDA installed; flash-attn / transformer-engine may be carried as wheels in
# .whl/ (installed with --no-index if present), else only SDPA is exercised.  < 8 minutes.
set -uo pipefail
OUT="${1:?usage: tools/device_check.sh OUT_DIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" || echo "megatron-core missing"
} > "$OUT/env.txt" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -rA > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
timeout 240 python3 tools/bench_gpu.py --out "$OUT" > "$OUT/gpu_bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/gpu_bench.log"
tail -n 3 "$OUT/gpu_tests.txt" "$OUT/gpu_bench.log"
