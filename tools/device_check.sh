#!/usr/bin/env bash
# The prepared GPU check: what a 15-minute GPU lease must measure, ended by an overall deadline
# (8 minutes by default) on one GPU or more.  Usage (repo root, no network needed):
#     bash tools/device_check.sh OUT_DIR
# OUT_DIR ends up holding exactly two files, both rewritten after every step, so whatever the lease
# returns is complete up to the last finished step (the device machine returns at most 8 files):
#   summary.txt        one screen: each step's status, time and headline numbers
#   results.tar.gz     every step's full output (below), in a folder of its own
# Inside the archive:
#   env.txt            GPUs, torch, CUDA, which optional packages import
#   gpu_tests.txt      tests/test_gpu.py, one line per test as it finishes (-v): kernels vs float64,
#                      ranks as threads on one GPU through the real exchange, NCCL worlds of every GPU
#   gpu_bench.{json,md}   tools/bench_gpu.py: kernels, the exchange's copies, GPTModel memory
#   gpu_model.{json,md}   tools/gpu_model_check.py: losses beside the CPU's, the device's bf16 peak,
#                      Ulysses vs the same kernel without Ulysses (tokens/s, memory, MFU, the chunked
#                      loss, labelled extra rows), one profiled step, lengths until OOM
#   pretrain.txt       the trainer on every GPU, bf16, --ulysses-degree = GPUs, chunked loss on
#   megatron_lm.txt    Megatron-LM's own pretrain_gpt.py through megatron_patches (at one GPU:
#                      Megatron-LM alone, --ulysses-degree 1 turns the patches off; labelled so)
#   longest.{json,md}  tools/longest_check.py: the plan's longest Llama-3-8B length for these GPUs,
#                      trained with the plan's flags (3/4 of it again after an out-of-memory), last:
#                      it takes what time is left (DEVICE_CHECK_STEPS=longest: that step alone)
# The rules of both prepared checks (deadline, the two files, skipped steps, DEVICE_CHECK_STEPS, the
# wheels in .whl/) are in tools/device_lib.sh; Megatron-LM's GPT scripts come from $MEGATRON_LM or
# .megatron-lm/.  A first 8-GPU node: tools/device_node_check.sh.
# DEVICE_CHECK_CPU=1: the same script on the CPU at small sizes (the suite's smoke run of it).
set -uo pipefail
OUT_ARG="${1:?usage: tools/device_check.sh OUT_DIR}" NAME="device check" DEFAULT_SECONDS=480
source "$(dirname "$0")/device_lib.sh"

if [ "$CPU" = 1 ]; then
  DEV=(--device cpu --quick)
  PRE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --micro-batch-size 1
       --global-batch-size 2 --train-iters 4 --log-interval 2 --ulysses-degree 1 --loss-chunk-tokens 64)
else
  DEV=()
  PRE=(--bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 8192
       --micro-batch-size 1 --global-batch-size "$((GPUS > 1 ? GPUS : 2))" --train-iters 20 --log-interval 5
       --ulysses-degree "$GPUS" --loss-chunk-tokens 2048)
  step gpu_tests 100 "$WORK/gpu_tests.txt" "$PY" -m pytest -v -m gpu tests/test_gpu.py -rA -p no:cacheprovider
  grep -E "passed|failed" "$WORK/gpu_tests.txt" | tail -n 1 | show
  grep -E "^(FAILED|ERROR)" "$WORK/gpu_tests.txt" | head -n 8 | show
  step bench_gpu 60 "$WORK/gpu_bench.log" "$PY" tools/bench_gpu.py --out "$WORK"
fi

if has megatron.core; then
  step model 170 "$WORK/gpu_model.log" "$PY" tools/gpu_model_check.py --out "$WORK" "${DEV[@]}"
  grep -E "^\| (ulysses|baseline|megatron)-" "$WORK/gpu_model.md" 2>/dev/null | cut -c1-150 | show
  grep -E "^\| (bfloat16|float32) \|" "$WORK/gpu_model.md" 2>/dev/null | sed 's/^/peak matmul: /' | show
  LAUNCH=("$PY")
  [ "$GPUS" -gt 1 ] && LAUNCH=("$PY" -m torch.distributed.run --nproc-per-node "$GPUS")
  step pretrain 60 "$WORK/pretrain.txt" "${LAUNCH[@]}" examples/pretrain_gpt.py "${PRE[@]}" --log-dir "$WORK/run"
  grep -E "iteration +[0-9]+/ +[0-9]+ \|" "$WORK/pretrain.txt" | tail -n 1 | cut -c1-220 | show

  MLM="${MEGATRON_LM:-$PWD/.megatron-lm}"
  if [ "$CPU" = 1 ]; then
    note "megatron_lm  skipped: CPU smoke run"
  elif [ -f "$MLM/pretrain_gpt.py" ] && has megatron.training; then
    WHAT="Megatron-LM's pretrain_gpt.py with --ulysses-degree $GPUS through the patches"
    [ "$GPUS" = 1 ] && WHAT="Megatron-LM alone (--ulysses-degree 1: the patches are off; one GPU has no Ulysses)"
    step megatron_lm 60 "$WORK/megatron_lm.txt" env PYTHONPATH="$MLM:$PYTHONPATH" CUDA_DEVICE_MAX_CONNECTIONS=1 \
      "$PY" -m torch.distributed.run --nproc-per-node "$GPUS" -m megatron_patches.launch "$MLM/pretrain_gpt.py" \
      --ulysses-degree "$GPUS" --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm \
      --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --bf16 \
      --num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 2048 --max-position-embeddings 2048 \
      --micro-batch-size 1 --global-batch-size "$GPUS" --train-iters 10 --lr 1e-4 --log-interval 5 --eval-iters 0 \
      --eval-interval 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --attention-dropout 0 \
      --hidden-dropout 0
    note "             ($WHAT)"
    grep -E "iteration +10/" "$WORK/megatron_lm.txt" | cut -c1-220 | show
  else
    note "megatron_lm  skipped: no Megatron-LM pretrain_gpt.py in \$MEGATRON_LM or .megatron-lm/, or no megatron.training"
  fi
else
  note "model, pretrain, megatron_lm skipped: megatron-core does not import (put its wheel in .whl/: tools/device_prepare.sh)"
fi
for m in transformer_engine.pytorch flash_attn; do
  grep -q "$m: missing" "$WORK/env.txt" && note "skipped for a missing $m: its kernel tests and benchmark rows (they say so)"
done
if has megatron.core; then
  LONG=(--seconds "$((DEADLINE - SECONDS - 20))")
  [ "$CPU" = 1 ] && LONG+=(--smoke --seq-length 1024)
  step longest 600 "$WORK/longest.log" "$PY" tools/longest_check.py --out "$WORK" "${LONG[@]}"
  grep -E "^\| [0-9,]+ \|" "$WORK/longest.md" 2>/dev/null | show
fi
finish
