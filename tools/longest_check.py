#!/usr/bin/env python3
"""The longest sequence this machine's GPUs train, with the plan's flags: the GPU check's last step.

    python tools/longest_check.py --out DIR [--world-size N] [--preset h100|h200] [--seconds S]

1. ``ulysses-mcore plan --longest`` for the model (default: Llama-3-8B, ALST's 500K-on-one-H100
   model) on ``--world-size`` GPUs of ``--preset`` (default: by the device's name) names a length
   and the layout and memory flags that reach it, and prints the dry-run command that checks it;
2. that command becomes ``ulysses-mcore pretrain`` (the same flags, ``--vocab-size`` included:
   the embedding and output layer have the model's size, the data are byte tokens) on this
   machine's GPUs, for ``--iters`` optimizer steps (the first is the whole step: the peak);
3. out of memory: the length again at 3/4, while ``--seconds`` last.

``longest.json`` / ``longest.md`` in ``--out``: per try, the length, fitted or not, the trainer's
peak memory and step time beside the plan's peak.  ``--smoke``: the same code on the CPU with a
tiny model at a given ``--seq-length`` (tests/test_tools_longest_check.py), so the GPU lease never
meets a function that is gone.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LLAMA3_8B = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
    "--ffn-hidden-size 14336 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
    "--vocab-size 128256 --disable-bias-linear"
)  # Llama 3 has no linear biases
TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000"
ITERATION = re.compile(r"iteration +(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*peak memory \(GB\): ([\d.]+)")
PLANNED = re.compile(r"planned peak ([\d.]+) GB")
GRAIN = 4096  # a shorter try stays a multiple of this: divisible by every degree the plan picks on one node


def plan(model_flags, world, preset):
    """(planned peak GB, the plan's dry-run command as argv, the plan's whole output)."""
    cmd = [sys.executable, "-m", "ulysses_mcore", "plan", "--longest", "--preset", preset, "--world-size", str(world)]
    out = subprocess.run(cmd + shlex.split(model_flags), capture_output=True, text=True, check=True).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("ulysses-mcore dryrun "), out
    return float(PLANNED.search(out).group(1)), shlex.split(last)[2:], out


def pretrain_argv(dryrun_argv, seq, iters, log_dir, on_cpu):
    """The dry-run command's flags as a training run of ``iters`` steps at ``seq`` tokens."""
    drop = {"--world-size", "--preset", "--seq-length", "--max-position-embeddings"}
    if on_cpu:  # Adam's state is in host memory already: the trainer refuses the flag on a CPU
        drop.add("--optimizer-cpu-offload")
    keep, i = [], 0
    while i < len(dryrun_argv):
        flag = dryrun_argv[i]
        takes_value = i + 1 < len(dryrun_argv) and not dryrun_argv[i + 1].startswith("--")
        if flag not in drop:
            keep += dryrun_argv[i : i + 1 + takes_value]
        i += 1 + takes_value
    run = ["--seq-length", str(seq), "--max-position-embeddings", str(seq), "--train-iters", str(iters)]
    return keep + run + ["--lr-warmup-iters", "0", "--log-interval", "1", "--log-dir", log_dir]


def train(argv, world, seconds):
    """One training run: (fitted, peak GB, first step's seconds, the output's tail)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pretrain_gpt.py")
    try:
        proc = subprocess.run(launch + [script] + argv, capture_output=True, text=True, timeout=seconds)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), "timeout"
    steps = ITERATION.findall(text)
    fitted = rc == 0 and bool(steps)
    peak = max((float(p) for _, _, p in steps), default=None)
    first = float(steps[0][1]) / 1e3 if steps else None
    why = "" if fitted else ("out of memory" if "out of memory" in text.lower() else f"rc {rc}")
    return fitted, peak, first, why, text[-2000:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--world-size", type=int, default=None, help="GPUs to train on (default: every visible one)")
    p.add_argument("--preset", choices=["h100", "h200"], default=None, help="default: by the device's name")
    p.add_argument("--model", default=LLAMA3_8B, help="the model's flags (default: Llama-3-8B)")
    p.add_argument("--iters", type=int, default=1, help="optimizer steps a try runs (default: 1)")
    p.add_argument("--seconds", type=float, default=300, help="every try together stops after this")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, --seq-length instead of the plan's")
    p.add_argument("--seq-length", type=int, default=None, help="train at this length, not the plan's")
    a = p.parse_args(argv)
    import torch

    on_cpu = a.smoke or not torch.cuda.is_available()
    name = "cpu" if on_cpu else torch.cuda.get_device_name()
    world = a.world_size or (1 if on_cpu else torch.cuda.device_count())
    preset = a.preset or ("h200" if "H200" in name.upper() else "h100")
    planned, dry, out = plan(TINY if a.smoke else a.model, world, preset)
    seq = a.seq_length or int(dry[dry.index("--seq-length") + 1])
    os.makedirs(a.out, exist_ok=True)
    samples = int(dry[dry.index("--global-batch-size") + 1])  # sequences a step
    record = dict(device=name, world=world, preset=preset, torch=torch.__version__, samples=samples, plan=out, tries=[])
    deadline = time.monotonic() + a.seconds
    while seq >= GRAIN // 4 and time.monotonic() < deadline - 30:
        print(f"[longest_check] {seq:,} tokens on {world} x {name} ...", flush=True)
        argv = pretrain_argv(dry, seq, a.iters, os.path.join(a.out, "run"), on_cpu)
        fitted, peak, step_s, why, tail = train(argv, world, deadline - time.monotonic())
        record["tries"].append(dict(seq=seq, fitted=fitted, peak_gb=peak, step_s=step_s, why=why, tail=tail))
        record["command"] = " ".join(["torchrun", f"--nproc-per-node {world}", "examples/pretrain_gpt.py", *argv])
        _write(a.out, record, planned)
        if fitted or why != "out of memory":
            break
        seq = seq * 3 // 4 // GRAIN * GRAIN
    return 0 if any(t["fitted"] for t in record["tries"]) else 1


def _write(out, record, planned):
    with open(os.path.join(out, "longest.json"), "w") as f:
        json.dump(dict(record, planned_peak_gb=planned), f, indent=1)
    lines = [
        f"# The longest sequence on {record['world']} x {record['device']} (torch {record['torch']}), "
        f"the plan's flags for {record['preset']} (planned peak {planned} GB)",
        "",
        "| tokens | trained | peak GB | first step s | tokens/s per GPU | why not |",
        "|---|---|---|---|---|---|",
    ]
    for t in record["tries"]:
        tps = f"{t['seq'] * record['samples'] / t['step_s'] / record['world']:.0f}" if t["step_s"] else "-"
        peak = "-" if t["peak_gb"] is None else f"{t['peak_gb']:.1f}"
        secs = "-" if t["step_s"] is None else f"{t['step_s']:.1f}"
        lines.append(f"| {t['seq']:,} | {'yes' if t['fitted'] else 'no'} | {peak} | {secs} | {tps} | {t['why']} |")
    lines += ["", "```", record.get("command", ""), "```"]
    with open(os.path.join(out, "longest.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
