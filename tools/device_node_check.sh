#!/usr/bin/env bash
# The prepared check of a first 8-GPU node: NCCL, the all-to-all and Ulysses at full degree against
# Megatron's own all-to-all context parallelism on the same model.  Usage (repo root, no network):
#     bash tools/device_node_check.sh OUT_DIR
# The rules of tools/device_check.sh (tools/device_lib.sh): an overall deadline (8 minutes by
# default), OUT_DIR holding exactly summary.txt and results.tar.gz, rewritten after every step, a
# failed step never stopping the next, DEVICE_CHECK_STEPS to run some.  Inside the archive:
#   env.txt            GPUs and their links (nvidia-smi topo), torch, CUDA, NCCL, optional packages
#   nccl_tests.txt     tests/test_gpu.py's NCCL worlds of every GPU (-k nccl): the exchange vs float64
#   bench_nccl.{json,md}  tools/bench_nccl.py: all_to_all_single bus bandwidth by size; ulysses_attention
#                      fwd+bwd (Llama-3-8B's heads) against its floor measured in the same run
#   pretrain.txt       ulysses-mcore's trainer, --ulysses-degree = GPUs, bf16, the model below
#   megatron_cp.txt    Megatron-LM's pretrain_gpt.py alone, --context-parallel-size = GPUs
#                      --cp-comm-type a2a (Megatron's own all-to-all CP: needs Transformer Engine)
#   megatron_lm.txt    Megatron-LM's pretrain_gpt.py with --ulysses-degree = GPUs through the patches
# The three training runs share one model (8 layers, hidden 2048, 16 q / 8 kv heads, 32K tokens):
# their last iteration's line (tokens/s, loss, memory) lands in summary.txt side by side.
# DEVICE_CHECK_CPU=1: the same script on the CPU, 2 gloo ranks, small sizes (the suite's smoke run).
set -uo pipefail
OUT_ARG="${1:?usage: tools/device_node_check.sh OUT_DIR}" NAME="node check" DEFAULT_SECONDS=480
source "$(dirname "$0")/device_lib.sh"

N=$GPUS SEQ=32768 ITERS=10
MODEL=(--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 8)
BENCH=()
if [ "$CPU" = 1 ]; then
  N=2 SEQ=256 ITERS=2 BENCH=(--quick)
  MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2)
else
  MODEL+=(--bf16)
  step nccl_tests 120 "$WORK/nccl_tests.txt" "$PY" -m pytest -v -m gpu tests/test_gpu.py -k nccl -rA -p no:cacheprovider
  grep -E "passed|failed" "$WORK/nccl_tests.txt" | tail -n 1 | show
fi
RUN=("$PY" -m torch.distributed.run --nproc-per-node "$N")
step bench_nccl 120 "$WORK/bench_nccl.log" "${RUN[@]}" tools/bench_nccl.py --out "$WORK" "${BENCH[@]}"
grep -E "^\| [0-9.]+ \|" "$WORK/bench_nccl.md" 2>/dev/null | show

SIZE=(--seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size 1 --global-batch-size 1
      --train-iters "$ITERS" --log-interval 1)
if has megatron.core; then
  step pretrain 120 "$WORK/pretrain.txt" "${RUN[@]}" examples/pretrain_gpt.py "${MODEL[@]}" "${SIZE[@]}" \
    --ulysses-degree "$N" --lr-warmup-iters 0 --log-dir "$WORK/run"
  grep -E "iteration +$ITERS/" "$WORK/pretrain.txt" | cut -c1-220 | show
else
  note "pretrain     skipped: megatron-core does not import (put its wheel in .whl/: tools/device_prepare.sh)"
fi

MLM="${MEGATRON_LM:-$PWD/.megatron-lm}"
MLM_FLAGS=(--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion
           --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --lr 1e-4 --eval-iters 0
           --eval-interval 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
           --attention-dropout 0 --hidden-dropout 0 --position-embedding-type rope)
megatron_lm() {  # megatron_lm NAME LOG FLAGS...: Megatron-LM's pretrain_gpt.py on every GPU, the shared model
  local name=$1 log=$2
  shift 2
  step "$name" 150 "$log" env PYTHONPATH="$MLM:$PYTHONPATH" CUDA_DEVICE_MAX_CONNECTIONS=1 "${RUN[@]}" \
    -m megatron_patches.launch "$MLM/pretrain_gpt.py" "${MODEL[@]}" "${SIZE[@]}" "${MLM_FLAGS[@]}" "$@"
  grep -E "iteration +$ITERS/" "$log" | cut -c1-220 | show
}
if [ "$CPU" = 1 ]; then
  note "megatron_cp  skipped: CPU smoke run"
  note "megatron_lm  skipped: CPU smoke run"
elif [ -f "$MLM/pretrain_gpt.py" ] && has megatron.training; then
  if has transformer_engine.pytorch; then
    megatron_lm megatron_cp "$WORK/megatron_cp.txt" --ulysses-degree 1 --transformer-impl transformer_engine \
      --context-parallel-size "$N" --cp-comm-type a2a
  else
    note "megatron_cp  skipped: Megatron's all-to-all context parallelism needs Transformer Engine (missing here)"
  fi
  megatron_lm megatron_lm "$WORK/megatron_lm.txt" --ulysses-degree "$N" --transformer-impl local
else
  note "megatron_cp, megatron_lm skipped: no Megatron-LM pretrain_gpt.py in \$MEGATRON_LM or .megatron-lm/, or no megatron.training"
fi
finish
