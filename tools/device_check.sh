#!/usr/bin/env bash
# One prepared GPU check for a single-GPU node with no network.  Usage: bash tools/device_check.sh OUT_DIR
# Needs torch with CUDA; megatron-core, flash-attn and transformer-engine are optional (wheels in
# .whl/ are installed with --no-index if present).  Writes every result into OUT_DIR:
#   env.txt          GPU, torch, what is installed
#   gpu_tests.txt    tests/test_gpu.py: kernels (and MLA / window / sinks / lse variants) vs float64, a threaded world of P ranks on the GPU
#                    vs float64 with the steady-state no-host-sync check (set_sync_debug_mode)
#   gpu_bench.*      tools/bench_gpu.py: kernels, layout copies, memory
#   pretrain.txt     a single-GPU pretrain run (throughput and peak memory), if megatron-core imports
# < 8 minutes in all.
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
  python3 -c "import flash_attn" 2>/dev/null && echo "flash-attn present" || echo "flash-attn missing"
  python3 -c "import transformer_engine" 2>/dev/null && echo "transformer-engine present" || echo "transformer-engine missing"
} > "$OUT/env.txt" 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -rA -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
timeout 150 python3 tools/bench_gpu.py --out "$OUT" > "$OUT/gpu_bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/gpu_bench.log"
if python3 -c "import megatron.core" 2>/dev/null; then
  timeout 120 python3 examples/pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 \
      --seq-length 4096 --micro-batch-size 1 --global-batch-size 4 --train-iters 10 --log-dir "$OUT/run" \
      > "$OUT/pretrain.txt" 2>&1
  echo "pretrain rc=$?" >> "$OUT/pretrain.txt"
fi
tail -n 3 "$OUT/gpu_tests.txt" "$OUT/gpu_bench.log" "$OUT"/pretrain.txt 2>/dev/null
