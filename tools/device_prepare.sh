#!/usr/bin/env bash
# Before a GPU lease, on this machine (network): fill the git-ignored folders tools/device_check.sh
# reads on the GPU machine, which has no network.
#   .whl/            wheels for the GPU machine's Python 3.12 (cp312, manylinux x86_64): megatron-core
#                    0.19.2 (its other needs, numpy and packaging, are there already); Transformer
#                    Engine's PyTorch extension and flash-attn only if binary wheels exist (checked
#                    2026-12: neither has one on PyPI -- transformer_engine_torch and flash-attn ship
#                    as source only, and the GPU machine cannot compile them without its own packages)
#   .megatron-lm/    Megatron-LM's GPT scripts for megatron-core 0.19 (from ../shared/megatron-lm-0.19 or
#                    $MEGATRON_LM_SRC), run there, never committed
# Then: run(command="bash tools/device_check.sh $OUT", carry=[".whl", ".megatron-lm"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pip_get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$1"
}
pip_get "megatron-core==0.19.2"
for pkg in transformer_engine_torch flash-attn; do
  pip_get "$pkg" 2>/dev/null && echo "device_prepare: $pkg wheel added" || echo "device_prepare: no binary wheel of $pkg (its parts of the check will say skipped)"
done
SRC="${MEGATRON_LM_SRC:-$(cd .. && pwd)/shared/megatron-lm-0.19}"
if [ -f "$SRC/pretrain_gpt.py" ]; then
  rm -rf .megatron-lm && mkdir .megatron-lm && cp "$SRC"/*.py .megatron-lm/
  echo "device_prepare: Megatron-LM's GPT scripts from $SRC in .megatron-lm/ (git-ignored)"
else
  echo "device_prepare: no Megatron-LM scripts at $SRC (set MEGATRON_LM_SRC): the megatron_lm step will skip"
fi
ls -la .whl .megatron-lm 2>/dev/null
du -sh .whl .megatron-lm 2>/dev/null
