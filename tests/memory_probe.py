"""What a step of the trainer's model adds to a rank's memory, measured for real on this machine's CPU:
the reference tests/test_dryrun_vs_real.py holds the dry run to.

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 \
        torchrun --nproc-per-node N -m tests.memory_probe OUT.json CASES.json

CASES.json: ``[{"name", "argv"}]``, ``argv`` the dry run's flags (``--world-size N`` included).  Per
case, every rank: the trainer's model (``model.build_model``, Megatron's DDP: the gradient buffer is
allocated before the step, as the dry run models it) and its micro-batch shard; one forward and
backward to warm up; then the resident set just before a second forward and backward, the kernel's
high-water mark reset (``/proc/self/clear_refs`` = 5), and ``VmHWM`` after it.  The all-to-all
buffer pool is off (on a CPU it keeps the buffers between steps; a GPU's caching allocator does not
count as held what a step frees).  glibc serves every
allocation above 64 KiB by mmap and gives it back at once (the environment above), so the resident
set follows the live tensors.  Rank 0 writes ``{name: the largest rank's step bytes}`` to OUT.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _args(argv):
    from ulysses_mcore.cli.dryrun import build_parser

    args = build_parser().parse_args(argv)
    args.fake_cuda = False  # a real CPU run: the CPU refusals apply
    return args


def _step(model, batch) -> None:
    from ulysses_mcore.megatron.trainer.training import model_forward

    out = model_forward(model, batch)
    out.backward(torch.ones_like(out))
    del out
    model.zero_grad_buffer()


def measure(argv) -> int:
    """The bytes one forward and backward of the flags' model add on top of what a rank held before it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from ulysses_mcore.megatron.layer.batch import make_lm_batch, shard_batch
    from ulysses_mcore.megatron.layer.groups import destroy, initialize
    from ulysses_mcore.megatron.trainer.arguments import validate
    from ulysses_mcore.megatron.trainer.model import build_model

    args = _args(argv)
    topo = validate(args, args.world_size)
    initialize(tp=topo.tp, ulysses=topo.ulysses, cp=topo.cp, pp=topo.pp, verbose=False)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model, _ = build_model(args, vocab_size=args.vocab_size)
    text = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1))
    batch = shard_batch(make_lm_batch(text), rank=ps.get_context_parallel_rank(), ulysses=topo.ulysses * topo.cp)
    _step(model, batch)  # warm: caches (rotary tables, the groups' buffers) made once
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the resident set now
    _step(model, batch)
    step = _status("VmHWM") - before
    del model, batch
    gc.collect()
    destroy()
    return step


def main(out_path: str, cases_path: str) -> None:
    warnings.filterwarnings("ignore")
    from ulysses_mcore.megatron.compat import cpu_compat
    from ulysses_mcore.exchange.transport import POOL

    cpu_compat.apply()
    POOL.enabled = False  # all-to-all buffers allocated per call, as on a GPU (the CPU pool keeps them across steps)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for case in json.load(open(cases_path)):
        mine = torch.tensor([measure(case["argv"])], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        results[case["name"]] = int(mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
