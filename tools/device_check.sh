#!/usr/bin/env bash
# The one prepared GPU check: everything a 15-minute GPU lease must measure, in < 8 minutes on one GPU
# or on an 8-GPU node.  Usage (repo root, no network needed):
#     bash tools/device_check.sh OUT_DIR
# Runs from the source tree: installs nothing into the system, never changes torch.  Wheels in .whl/
# (git-ignored; tools/device_prepare.sh downloads them on a machine with network: megatron-core for
# Python 3.12, and Transformer Engine / flash-attn only where binary wheels exist) go into a scratch
# folder; Megatron-LM's GPT scripts are taken from $MEGATRON_LM or .megatron-lm/ (git-ignored, also
# filled by device_prepare.sh).  A step that fails does not stop the next; a missing package skips
# the steps that need it, and summary.txt says which.  Every step writes its results into OUT_DIR as
# it produces them:
#   env.txt            GPUs, torch, CUDA, which optional packages import
#   gpu_tests.txt      tests/test_gpu.py: kernels vs float64 (sdpa / flash / TE, MLA, windows, sinks,
#                      lse, packed), P ranks as threads on one GPU through the real exchange (GQA,
#                      uneven heads, overlap, packed per-document with GPU cu_seqlens) with the
#                      no-host-sync check, and with ULYSSES_GPU_WORLD = the GPU count (>= 2) NCCL
#                      worlds of every GPU (Ulysses, Ulysses x ring)
#   gpu_bench.{json,md}   tools/bench_gpu.py: kernels, the exchange's copies, GPTModel memory
#   gpu_model.{json,md}   tools/gpu_model_check.py: losses beside the CPU's, Ulysses vs Megatron's own
#                      attention (tokens/s, peak memory), one profiled step, lengths until OOM
#   pretrain.txt       the trainer (examples/pretrain_gpt.py) on every GPU, bf16, --ulysses-degree = GPUs
#   megatron_lm.txt    Megatron-LM's own pretrain_gpt.py through megatron_patches with --ulysses-degree
#   summary.txt        one screen: each step's status and headline numbers
set -uo pipefail
PY=${PYTHON:-python3}  # the Python that holds torch with CUDA
OUT="${1:?usage: tools/device_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
export ULYSSES_GPU_WORLD=$GPUS
[ "$GPUS" -ge 1 ] || { note "no CUDA GPU visible to $PY (set PYTHON= to the Python with CUDA torch): nothing to check"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || note "wheels in .whl/ did not install"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpus', torch.cuda.device_count())"
  for m in megatron.core transformer_engine.pytorch flash_attn flash_attn_interface; do
    has "$m" && echo "$m: present" || echo "$m: missing"
  done
} > "$OUT/env.txt" 2>&1
note "device check: $GPUS GPU(s); $(grep -c missing "$OUT/env.txt") optional package(s) missing (env.txt)"

step() {  # step NAME SECONDS LOG COMMAND...: run with a timeout, record rc and time, never stop the script
  local name=$1 secs=$2 log=$3 t0=$SECONDS rc
  shift 3
  timeout "$secs" "$@" > "$log" 2>&1
  rc=$?
  note "$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")$([ $rc = 124 ] && echo " (timed out at ${secs}s)")"
  return $rc
}

step gpu_tests 120 "$OUT/gpu_tests.txt" "$PY" -m pytest -q -m gpu tests/test_gpu.py -rA -p no:cacheprovider
grep -E "passed|failed" "$OUT/gpu_tests.txt" | tail -n 1 | sed 's/^/             /' | tee -a "$SUMMARY"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.txt" | head -n 8 | sed 's/^/             /' | tee -a "$SUMMARY"

step bench_gpu 60 "$OUT/gpu_bench.log" "$PY" tools/bench_gpu.py --out "$OUT"

if has megatron.core; then
  step model 150 "$OUT/gpu_model.log" "$PY" tools/gpu_model_check.py --out "$OUT"
  grep -E "^\| (ulysses|megatron)-" "$OUT/gpu_model.md" 2>/dev/null | sed 's/^/             /' | tee -a "$SUMMARY"
  grep -E "^\| 20 \|" "$OUT/gpu_model.md" 2>/dev/null | sed 's/^/             loss at 20 (GPU | CPU | rel): /' | tee -a "$SUMMARY"

  PRE=(--bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 8192
       --micro-batch-size 1 --global-batch-size "$((GPUS > 1 ? GPUS : 2))" --train-iters 20 --log-interval 5
       --ulysses-degree "$GPUS" --log-dir "$OUT/run")
  if [ "$GPUS" -gt 1 ]; then
    step pretrain 60 "$OUT/pretrain.txt" "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" examples/pretrain_gpt.py "${PRE[@]}"
  else
    step pretrain 60 "$OUT/pretrain.txt" "$PY" examples/pretrain_gpt.py "${PRE[@]}"
  fi
  grep -E "iteration +20/" "$OUT/pretrain.txt" | sed 's/^/             /' | tee -a "$SUMMARY"

  MLM="${MEGATRON_LM:-$PWD/.megatron-lm}"
  if [ -f "$MLM/pretrain_gpt.py" ] && has megatron.training; then
    step megatron_lm 60 "$OUT/megatron_lm.txt" env PYTHONPATH="$MLM:$PYTHONPATH" CUDA_DEVICE_MAX_CONNECTIONS=1 \
      "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" -m megatron_patches.launch "$MLM/pretrain_gpt.py" \
      --ulysses-degree "$GPUS" --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm \
      --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --bf16 \
      --num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 \
      --micro-batch-size 1 --global-batch-size "$GPUS" --train-iters 10 --lr 1e-4 --log-interval 5 --eval-iters 0 \
      --eval-interval 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --attention-dropout 0 \
      --hidden-dropout 0
    grep -E "iteration +10/" "$OUT/megatron_lm.txt" | sed 's/^/             /' | tee -a "$SUMMARY"
  else
    note "megatron_lm  skipped: no Megatron-LM pretrain_gpt.py in \$MEGATRON_LM or .megatron-lm/, or no megatron.training"
  fi
else
  note "model, pretrain, megatron_lm skipped: megatron-core does not import (put its wheel in .whl/: tools/device_prepare.sh)"
fi
for m in transformer_engine.pytorch flash_attn; do
  has "$m" || note "skipped for a missing $m: its kernel tests and benchmark rows (they say so in their files)"
done
echo "===== summary ($SUMMARY)"
cat "$SUMMARY"
