# Shared by the prepared GPU checks (tools/device_check.sh, tools/device_node_check.sh); sourced, not
# run.  The caller sets OUT_ARG (the output folder), NAME (the check's name) and DEFAULT_SECONDS.
# Gives: PY, GPUS, CPU, OUT, WORK, DEADLINE; note (a line to summary.txt and the screen), pack
# (results.tar.gz, rewritten after every step), has MODULE, step NAME SECONDS LOG COMMAND..., show.
# OUT ends up holding exactly summary.txt and results.tar.gz (the device machine returns at most 8
# files), complete up to the last finished step.  A failed step does not stop the next; one that would
# start past the overall deadline is skipped and summary.txt says so; DEVICE_CHECK_STEPS (a comma list)
# runs only the steps it names.  Wheels in .whl/ (git-ignored, tools/device_prepare.sh) go into a
# scratch folder; nothing is installed into the system, torch is never changed.
PY=${PYTHON:-python3}  # the Python that holds torch with CUDA
DEADLINE=$((SECONDS + ${DEVICE_CHECK_SECONDS:-$DEFAULT_SECONDS}))
CPU=${DEVICE_CHECK_CPU:-0}
ONLY=${DEVICE_CHECK_STEPS:-}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -lt 1 ] && [ "$CPU" != 1 ]; then
  echo "$NAME: no CUDA GPU visible to $PY (set PYTHON= to the Python with CUDA torch); nothing written" >&2
  exit 1
fi
mkdir -p "$OUT_ARG" && OUT=$(cd "$OUT_ARG" && pwd)
WORK=$(mktemp -d)/device_check && mkdir -p "$WORK"
trap 'rm -rf "$(dirname "$WORK")"' EXIT
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore ULYSSES_GPU_WORLD=$GPUS
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
pack() { tar czf "$OUT/results.tar.gz.tmp" --exclude=device_check/run/data -C "$(dirname "$WORK")" device_check && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/../site" .whl/*.whl \
    && export PYTHONPATH="$WORK/../site${PYTHONPATH:+:$PYTHONPATH}" || note "wheels in .whl/ did not install"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: none"
  nvidia-smi topo -m 2>/dev/null | head -n 12
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-', '| gpus', torch.cuda.device_count())"
  for m in megatron.core transformer_engine.pytorch flash_attn flash_attn_interface; do
    has "$m" && echo "$m: present" || echo "$m: missing"
  done
} > "$WORK/env.txt" 2>&1
note "$NAME: $GPUS GPU(s)$([ "$CPU" = 1 ] && echo ", CPU smoke run"); deadline in $((DEADLINE - SECONDS)) s; $(grep -c missing "$WORK/env.txt") optional package(s) missing${ONLY:+; only: $ONLY}"
pack

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
step() {  # step NAME SECONDS LOG COMMAND...: timed out at min(SECONDS, the time left), never stops the script
  local name=$1 want=$2 log=$3 t0=$SECONDS rc left=$((DEADLINE - SECONDS - 5))
  shift 3
  wanted "$name" || return 125
  if [ "$left" -lt 15 ]; then
    note "$(printf '%-12s skipped: the overall deadline is %ss away' "$name" "$((DEADLINE - SECONDS))")"
    return 124
  fi
  local secs=$((want < left ? want : left))
  timeout -k 5 "$secs" "$@" > "$log" 2>&1
  rc=$?
  note "$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")$([ $rc = 124 ] && echo " (timed out at ${secs}s)")"
  pack
  return $rc
}
show() { sed 's/^/             /' | tee -a "$SUMMARY"; }
finish() {
  note "$NAME done in $((SECONDS - DEADLINE + ${DEVICE_CHECK_SECONDS:-$DEFAULT_SECONDS})) s"
  pack
  echo "===== summary ($SUMMARY; everything in $OUT/results.tar.gz)"
}
