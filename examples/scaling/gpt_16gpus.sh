#!/usr/bin/env bash
# 16 GPUs (2 node(s) x 8): tp 2 x ulysses 4 x pp 2 x dp 1; an 8B Llama-style GPT
# (32 layers, hidden 4096, 32 q / 8 kv heads, ffn 14336), bf16, full recompute, distributed optimizer.
# Target sequence length 393216 tokens: ulysses-mcore plan predicts it fits in 70 GB per GPU
#   ulysses-mcore plan --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 \
#     --ffn-hidden-size 14336 --swiglu --vocab-size 128256 --bf16 --recompute full --use-distributed-optimizer \
#     --loss-chunk-tokens 4096 --mlp-chunk-tokens 4096 --budget-gb 70 --tp 2 --ulysses 4 --pp 2 --dp 1
# (The plan assumes SwiGLU and a 128K vocabulary; this script's GELU MLP and byte-level vocabulary need less.)
# tp x ulysses = 8 ranks stay inside one node (the default order puts Ulysses right after TP).
# Run on every node with NODE_RANK, MASTER_ADDR set; DATA is a Megatron .bin/.idx prefix.
set -euo pipefail
DATA=${DATA:?set DATA to an indexed-dataset prefix (ulysses-mcore preprocess)}
SEQ=${SEQ:-393216}
torchrun --nnodes 2 --node-rank ${NODE_RANK:-0} --nproc-per-node 8 \
  --master-addr ${MASTER_ADDR:-127.0.0.1} --master-port ${MASTER_PORT:-29500} \
  examples/pretrain_gpt.py \
  --tensor-model-parallel-size 2 --ulysses-degree 4 --pipeline-model-parallel-size 2 \
  --use-distributed-optimizer --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 \
  --num-attention-heads 32 --num-query-groups 8 --seq-length $SEQ --max-position-embeddings $SEQ \
  --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 --lr 3e-4 --min-lr 3e-5 \
  --lr-warmup-iters 50 --clip-grad 1.0 --weight-decay 0.1 --bf16 --recompute-granularity full --loss-chunk-tokens 4096 --mlp-chunk-tokens 4096 \
  --attention-backend te --data-path $DATA --save ${SAVE:-ckpt_16gpus} --save-interval 200 \
  --eval-interval 200 --eval-iters 4 --log-interval 1
