"""The catalogue of wrong configurations and inputs, across the API, the topology and
examples/pretrain_gpt.py.  Each must give a clear error naming the cause and the fix, the
same on every rank, and every process must exit within seconds (asserted with timeouts).

Documented non-errors: non-contiguous q/k/v are handled exactly (no copy demanded); a
tensor in the wrong layout whose shapes are plausible cannot be told apart from a right
one, and ranks passing *different* groups cannot be detected without a world-wide
collective -- neither is in the catalogue.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port, run_threaded, run_threaded_errors
from tests.test_bad_input import CASES as API_CASES
from ulysses_mcore.topology import Topology, TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr-warmup-iters", "1"]
COUNT = {"cases": 0}


# ---------------------------------------------------------------- API (threaded world of 4)
@pytest.mark.parametrize("name", list(API_CASES))
def test_api(name):
    make, extra, needles = API_CASES[name]

    def rank_fn(rank, world):
        opts = {"causal": rank != 2} if extra == "causal_by_rank" else {"causal": True, **extra}
        import ulysses_mcore

        ulysses_mcore.ulysses_attention(**make(rank, world), group=dist.group.WORLD, **opts)

    t0 = time.time()
    errors = run_threaded_errors(4, rank_fn)
    assert time.time() - t0 < 30
    assert len({str(e) for e in errors}) == 1 and all(isinstance(e, ValueError) for e in errors)
    assert all(n in str(errors[0]) for n in needles)


def test_non_contiguous_inputs_are_exact_not_errors():
    from tests.helpers import reference_attention

    full = torch.randn(16, 2, 4, 8).transpose(0, 1).contiguous().transpose(0, 1)  # sbhd, non-contiguous

    def rank_fn(rank, world):
        import ulysses_mcore

        q = full.chunk(world)[rank]
        assert not q.is_contiguous()
        return ulysses_mcore.ulysses_attention(q, q, q, group=dist.group.WORLD, causal=True)

    out = torch.cat(run_threaded(2, rank_fn))
    ref = reference_attention(full, full, full, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5


# ---------------------------------------------------------------- topology (pure)
TOPO = [
    (dict(world_size=12, tp=2, ulysses=4, pp=2), None, "does not divide WORLD_SIZE(12)"),
    (dict(world_size=8, tp=0), None, "--tensor-model-parallel-size must be an integer >= 1"),
    (dict(world_size=8, pp=1.5), None, "--pipeline-model-parallel-size must be an integer"),
    (dict(world_size=8, ulysses=2, order="tp-ulysses-cp-dp-zz"), None, "unknown axis"),
    (dict(world_size=8, ulysses=2, order="tp-cp-dp-pp"), None, "lacks axis 'ulysses'"),
    (dict(world_size=8, order="tp-cp-ulysses-dp-pp"), None, "'cp' must come right after 'ulysses'"),
    (dict(world_size=12, tp=2, ep=4), None, "--expert-model-parallel-size"),
    (dict(world_size=16, pp=2, ep=4, order="tp-ulysses-cp-ep-pp-dp"), None, "put 'pp' last"),
    (dict(world_size=8, tp=2, ulysses=4), dict(num_attention_heads=6), "larger than the 3 query heads"),
    (dict(world_size=8, tp=2, ulysses=2), dict(num_attention_heads=20, num_query_groups=6), "multiple of kv heads (3)"),
    (dict(world_size=8, tp=4), dict(num_attention_heads=6), "--tensor-model-parallel-size 4 must divide"),
    (dict(world_size=8, ulysses=2, cp=2), dict(num_attention_heads=8, seq_length=100), "--seq-length 100"),
    (dict(world_size=8, ulysses=8), dict(num_attention_heads=16, num_query_groups=3), "multiple of kv heads (3)"),
]


@pytest.mark.parametrize("topo,model,needle", TOPO)
def test_topology(topo, model, needle):
    with pytest.raises(TopologyError) as e:
        t = Topology(**topo)
        if model:
            t.check_model(**model)
    assert needle in str(e.value), str(e.value)


# ---------------------------------------------------------------- examples/pretrain_gpt.py
def run_ranks(n, args, cwd, timeout=120, script=SCRIPT):
    """``n`` ranks as separate processes (no launcher killing the others): each must exit by itself."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=str(cwd)))
    out = []
    t0 = time.time()
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank did not exit within {timeout}s")
        out.append((p.returncode, o, e))
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ulysses_mcore.megatron.data import read_documents, write_indexed_dataset, EMBEDDED_CORPUS

    d = tmp_path_factory.mktemp("assets")
    prefix = str(d / "good")
    write_indexed_dataset(read_documents(EMBEDDED_CORPUS), prefix, progress=False)
    raw = open(prefix + ".bin", "rb").read()
    with open(d / "trunc.bin", "wb") as f:
        f.write(raw[: len(raw) // 2])
    os.link(prefix + ".idx", d / "trunc.idx")
    with open(d / "corrupt.idx", "wb") as f:
        f.write(b"not an index" * 10)
    os.link(prefix + ".bin", d / "corrupt.bin")
    (d / "empty_ckpt").mkdir()
    res = run_ranks(1, SMALL + ["--save", str(d / "ckpt"), "--data-path", prefix], d, timeout=300)
    assert res[0][0] == 0, res[0][2][-2000:]
    return d, prefix


PRETRAIN = [
    # (name, extra args, ranks, needle) -- {d}: the assets folder, {p}: a good dataset prefix
    ("unknown flag", ["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    ("world size mismatch", ["--ulysses-degree", "3"], 2, "does not divide WORLD_SIZE(2)"),
    ("heads vs degree", ["--ulysses-degree", "2", "--num-attention-heads", "1", "--num-query-groups", "1"], 2,
     "--ulysses-degree 2 does not fit"),
    ("sequence vs degree", ["--ulysses-degree", "2", "--seq-length", "66"], 2, "--seq-length 66"),
    ("global batch", ["--global-batch-size", "3"], 2, "--global-batch-size 3"),
    ("save interval without save", ["--save-interval", "1"], 2, "--save-interval needs --save"),
    ("load not a directory", ["--load", "/nonexistent/ckpt"], 2, "--load /nonexistent/ckpt is not a directory"),
    ("sequence parallel on CPU", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--sequence-parallel needs Transformer Engine or apex"),
    ("flash on CPU", ["--attention-backend", "flash"], 2, "--attention-backend flash needs a CUDA GPU"),
    ("ring with flash", ["--context-parallel-size", "2", "--attention-backend", "flash"], 2,
     "--context-parallel-size > 1 runs the ring with --attention-backend sdpa"),
    ("TE ring with packed documents", ["--context-parallel-size", "2", "--attention-backend", "te",
                                       "--reset-attention-mask"], 2, "--reset-attention-mask with --context-parallel-size > 1"),
    ("missing dataset", ["--data-path", "{d}/nothing"], 2, "nothing.bin is missing"),
    ("truncated dataset", ["--data-path", "{d}/trunc"], 2, "trunc.bin is truncated"),
    ("corrupt index", ["--data-path", "{d}/corrupt"], 2, "corrupt.idx is not a valid Megatron index"),
    ("not a checkpoint", ["--data-path", "{p}", "--load", "{d}/empty_ckpt"], 2, "no latest_checkpointed_iteration.txt"),
    ("incompatible checkpoint", ["--data-path", "{p}", "--load", "{d}/ckpt", "--hidden-size", "32"], 2,
     "incompatible model: --hidden-size 64 (checkpoint) vs 32 (now)"),
]


SPAWNED = {"unknown flag", "world size mismatch", "missing dataset", "truncated dataset", "corrupt index",
           "not a checkpoint", "incompatible checkpoint"}  # the rest are flag checks: run in-process


@pytest.mark.spawn
@pytest.mark.parametrize("name,extra,n,needle", [c for c in PRETRAIN if c[0] in SPAWNED],
                         ids=[c[0] for c in PRETRAIN if c[0] in SPAWNED])
def test_pretrain(assets, name, extra, n, needle):
    d, prefix = assets
    args = SMALL + [a.format(d=d, p=prefix) for a in extra]
    t0 = time.time()
    res = run_ranks(n, args, d, timeout=120)
    elapsed = time.time() - t0
    for rank, (rc, _, err) in enumerate(res):
        assert rc == 2, (rank, rc, err[-2000:])
        assert needle in err, (rank, err[-2000:])
    messages = {next(ln for ln in err.splitlines() if "error:" in ln) for _, _, err in res}
    assert len(messages) == 1, messages  # the same message on every rank
    assert elapsed < 120


@pytest.mark.parametrize("name,extra,n,needle", [c for c in PRETRAIN if c[0] not in SPAWNED],
                         ids=[c[0] for c in PRETRAIN if c[0] not in SPAWNED])
def test_pretrain_flag_checks(name, extra, n, needle, monkeypatch, capsys):
    """Flag checks run before torch.distributed starts, the same on every rank: in-process."""
    from tests.test_pretrain import run_main_in_process

    rc, err = run_main_in_process(SMALL + extra, monkeypatch, capsys, world_size=n)
    assert rc == 2 and needle in err, err[-2000:]


def test_catalogue_size():
    assert len(API_CASES) + len(TOPO) + len(PRETRAIN) >= 25
