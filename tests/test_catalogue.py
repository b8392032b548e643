"""The catalogue of wrong configurations and inputs, across the topology and examples/pretrain_gpt.py
(the API's: tests/test_bad_input.py).  Each must give a clear error naming the cause and the fix, the
same on every rank, and every process must exit within seconds (asserted with timeouts).

Documented non-errors: non-contiguous q/k/v are handled exactly (no copy demanded); a
tensor in the wrong layout whose shapes are plausible cannot be told apart from a right
one, and ranks passing *different* groups cannot be detected without a world-wide
collective -- neither is in the catalogue.
"""

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from tests import helpers
from tests.helpers import run_threaded
from ulysses_mcore.topology import Topology, TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "2",
    "--lr-warmup-iters",
    "1",
]


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
    """``n`` ranks of the pretrain script as separate processes (tests.helpers.run_ranks)."""
    return helpers.run_ranks(n, args, cwd, timeout=timeout, script=script)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A good dataset, damaged copies of it, and a good checkpoint (iterations 2 and 4, one rank)."""
    from ulysses_mcore.megatron.trainer.data import read_documents, write_indexed_dataset, EMBEDDED_CORPUS

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
    res = run_ranks(
        1,
        SMALL
        + [
            "--save",
            str(d / "ckpt"),
            "--data-path",
            prefix,
            "--train-iters",
            "4",
            "--save-interval",
            "2",
            "--log-dir",
            str(d / "ckpt_log"),
        ],
        d,
        timeout=300,
    )
    assert res[0][0] == 0, res[0][2][-2000:]
    assert "successfully saved checkpoint from iteration       4 to" in res[0][1]
    return d, prefix


# the flag checks: before torch.distributed starts, identical on every rank -> in-process
FLAGS = [
    ("unknown flag", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("world size mismatch", ["--ulysses-degree", "3"], "does not divide WORLD_SIZE(2)"),
    (
        "heads vs degree",
        ["--ulysses-degree", "2", "--num-attention-heads", "1", "--num-query-groups", "1"],
        "--ulysses-degree 2 does not fit",
    ),
    ("sequence vs degree", ["--ulysses-degree", "2", "--seq-length", "66"], "--seq-length 66"),
    ("global batch", ["--global-batch-size", "3"], "--global-batch-size 3"),
    ("save interval without save", ["--save-interval", "1"], "--save-interval needs --save"),
    ("load not a directory", ["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt is not a directory"),
    (
        "sequence parallel on CPU",
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "--sequence-parallel needs Transformer Engine or apex",
    ),
    ("flash on CPU", ["--attention-backend", "flash"], "--attention-backend flash needs a CUDA GPU"),
    (
        "ring with flash",
        ["--context-parallel-size", "2", "--attention-backend", "flash"],
        "--context-parallel-size > 1 runs the ring with --attention-backend sdpa",
    ),
    (
        "TE ring with packed documents",
        ["--context-parallel-size", "2", "--attention-backend", "te", "--reset-attention-mask"],
        "--reset-attention-mask with --context-parallel-size > 1",
    ),
    # ranges: each must be named before it reaches a modulo, an allocation or Megatron
    ("micro batch 0", ["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    ("negative sequence", ["--seq-length", "-8"], "--seq-length must be >= 1, got -8"),
    ("zero sequence", ["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    ("vocab multiple 0", ["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1, got 0"),
    ("query groups 0", ["--num-query-groups", "0"], "--num-query-groups must be >= 1 (the number of KV heads), got 0"),
    ("hidden 0", ["--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    ("layers 0", ["--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    ("eval interval -1", ["--eval-interval", "-1"], "--eval-interval must be >= 1, got -1"),
    ("save interval 0", ["--save", "{d}/s", "--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    ("split abc", ["--split", "abc"], "--split abc: not a list of numbers"),
    ("split no training", ["--split", "0,100,0"], "--split 0,100,0: the training weight is 0"),
    ("split four parts", ["--split", "1,2,3,4"], "--split 1,2,3,4: give up to three non-negative weights"),
    (
        "timeout 0",
        ["--distributed-timeout-minutes", "0"],
        "--distributed-timeout-minutes must be a finite number in (0, inf)",
    ),
    ("lr nan", ["--lr", "nan"], "--lr must be a finite number in [0, inf), got nan"),
    ("lr inf", ["--lr", "inf"], "--lr must be a finite number in [0, inf), got inf"),
    ("warmup -1", ["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0 (0: no warmup), got -1"),
    ("clip -1", ["--clip-grad", "-1"], "--clip-grad must be a finite number in [0, inf) (0: no clipping), got -1.0"),
    ("beta2 1", ["--adam-beta2", "1"], "--adam-beta2 must be a finite number in [0, 1), got 1.0"),
    ("seed -1", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("min lr above lr", ["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr 0.001 is above --lr 0.0001"),
    (
        "positions below sequence",
        ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "32"],
        "--max-position-embeddings 32 is below --seq-length 64",
    ),
    (
        "scheduler flags contradict",
        ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
        "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict",
    ),
    ("exit interval 0", ["--exit-interval", "0"], "--exit-interval must be >= 1, got 0"),
    ("loss chunk 0", ["--loss-chunk-tokens", "0"], "--loss-chunk-tokens must be >= 1, got 0; leave it out"),
    ("mlp chunk -1", ["--mlp-chunk-tokens", "-1"], "--mlp-chunk-tokens must be >= 1, got -1; leave it out"),
    (
        "exit duration 0",
        ["--exit-duration-in-mins", "0"],
        "--exit-duration-in-mins must be a finite number in (0, inf)",
    ),
    # output paths: created and write-tested at start, not found at the first save
    (
        "save under a file",
        ["--save", "{d}/afile/ckpt"],
        "--save {d}/afile/ckpt: cannot write there ({d}/afile is a file, not a directory)",
    ),
    ("log dir under a file", ["--log-dir", "{d}/afile/logs"], "--log-dir {d}/afile/logs: cannot write there"),
]


@pytest.mark.parametrize("name,extra,needle", FLAGS, ids=[c[0] for c in FLAGS])
def test_pretrain_flag_checks(name, extra, needle, tmp_path, monkeypatch, capsys):
    """Flag checks run before torch.distributed starts, the same on every rank: in-process."""
    from tests.test_pretrain import run_main_in_process

    (tmp_path / "afile").write_text("x")
    t0 = time.time()
    rc, err = run_main_in_process(SMALL + [a.format(d=tmp_path) for a in extra], monkeypatch, capsys, world_size=2)
    assert rc == 2 and needle.format(d=tmp_path) in err, err[-2000:]
    assert time.time() - t0 < 10


@pytest.fixture
def tmpfs(tmp_path):
    """A mounted tmpfs (root only): a small or read-only file system, for real ENOSPC / EROFS."""
    mounted = []

    def mount(name, opts):
        d = tmp_path / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:100]}): needs root")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_save_on_a_read_only_file_system_is_named_at_start(tmpfs, monkeypatch, capsys):
    from tests.test_pretrain import run_main_in_process

    ro = tmpfs("ro", "ro,size=1m")
    rc, err = run_main_in_process(SMALL + ["--save", str(ro / "ckpt")], monkeypatch, capsys, world_size=2)
    assert rc == 2 and f"--save {ro}/ckpt: cannot write there (Read-only file system)" in err, err[-2000:]


def _damaged(d, name, damage):
    """A copy of the good checkpoint with one thing broken; returns its folder."""
    import shutil

    dst = d / "damaged" / name
    shutil.copytree(d / "ckpt", dst, ignore=shutil.ignore_patterns("metrics.csv"))
    it = dst / "iter_0000004"
    shard = sorted(it.glob("*.distcp"))[0]
    if damage == "latest iter_2":
        (dst / "latest_checkpointed_iteration.txt").write_text("iter_2")
    elif damage == "latest missing":
        (dst / "latest_checkpointed_iteration.txt").write_text("9")
    elif damage == "train_state empty":
        (it / "train_state.pt").write_bytes(b"")
    elif damage == "train_state garbage":
        (it / "train_state.pt").write_bytes(os.urandom((it / "train_state.pt").stat().st_size))
    elif damage == "shard truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "shard corrupted":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + 64] = os.urandom(64)
        shard.write_bytes(bytes(raw))
    elif damage == "metadata missing":
        (it / ".metadata").unlink()
    elif damage == "metadata garbage":
        (it / ".metadata").write_bytes(os.urandom((it / ".metadata").stat().st_size))
    elif damage == "no manifest, shard truncated":
        (it / "ulysses_manifest.json").unlink()
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "no manifest, metadata garbage":
        (it / "ulysses_manifest.json").unlink()
        (it / ".metadata").write_bytes(b"garbage" * 10)
    elif damage == "re-save an iteration":  # resume from 2 into the same folder and log: 3 and 4 again
        (dst / "latest_checkpointed_iteration.txt").write_text("2")
        (d / "damaged" / (name + "_log")).mkdir()
        shutil.copy(d / "ckpt_log" / "metrics.csv", d / "damaged" / (name + "_log") / "metrics.csv")
    elif damage == "interrupted re-save":  # what a kill between publish's two renames leaves
        os.replace(it, str(it) + ".old")
    else:
        raise ValueError(damage)
    return dst


# (name, argv, expected rc, needles) -- {d}: assets, {p}: good data prefix, {k}: the case's checkpoint, {t}: tmpfs
WORLD = [
    ("missing dataset", ["--data-path", "{d}/nothing"], 2, ["nothing.bin is missing"]),
    ("truncated dataset", ["--data-path", "{d}/trunc"], 2, ["trunc.bin is truncated"]),
    ("corrupt index", ["--data-path", "{d}/corrupt"], 2, ["corrupt.idx is not a valid Megatron index"]),
    ("not a checkpoint", ["--load", "{d}/empty_ckpt"], 2, ["no latest_checkpointed_iteration.txt"]),
    (
        "incompatible checkpoint",
        ["--load", "{d}/ckpt", "--hidden-size", "32", "--train-iters", "4"],
        2,
        ["incompatible model: --hidden-size 64 (checkpoint) vs 32 (now)"],
    ),
    (
        "latest iter_2",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        ["latest_checkpointed_iteration.txt holds 'iter_2', not an iteration number", "--load {k}"],
    ),
    (
        "latest missing",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        ["names iteration 9 but {k}/iter_0000009 is missing"],
    ),
    (
        "train_state empty",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        ["{k}/iter_0000004/train_state.pt: empty (0 bytes)"],
    ),
    (
        "train_state garbage",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        ["{k}/iter_0000004/train_state.pt: corrupted (CRC-32"],
    ),
    ("shard truncated", ["--load", "{k}", "--train-iters", "4"], 2, ["is damaged", ".distcp: truncated (100 of"]),
    ("shard corrupted", ["--load", "{k}", "--train-iters", "4"], 2, ["is damaged", ".distcp: corrupted (CRC-32"]),
    ("metadata missing", ["--load", "{k}", "--train-iters", "4"], 2, ["{k}/iter_0000004/.metadata: missing"]),
    ("metadata garbage", ["--load", "{k}", "--train-iters", "4"], 2, ["{k}/iter_0000004/.metadata: corrupted (CRC-32"]),
    (
        "no manifest, shard truncated",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        [".distcp: truncated (100 of at least"],
    ),
    (
        "no manifest, metadata garbage",
        ["--load", "{k}", "--train-iters", "4"],
        2,
        ["{k}/iter_0000004/.metadata: unreadable ("],
    ),
    (
        "schedule changed",
        ["--load", "{d}/ckpt", "--train-iters", "6", "--lr", "1e-3"],
        2,
        [
            "the learning-rate schedule differs from the checkpoint's: --lr 0.003 (checkpoint) vs 0.001 (now); "
            "--train-iters 4 (checkpoint) vs 6 (now)",
            "--override-opt_param-scheduler",
            "--use-checkpoint-opt_param-scheduler",
        ],
    ),
    (
        "schedule overridden",
        ["--load", "{d}/ckpt", "--train-iters", "6", "--override-opt_param-scheduler", "--log-dir", "{d}/log_override"],
        0,
        ["at iteration 4 (8 samples consumed)"],
    ),
    (
        "schedule from checkpoint",
        [
            "--load",
            "{d}/ckpt",
            "--train-iters",
            "6",
            "--use-checkpoint-opt_param-scheduler",
            "--log-dir",
            "{d}/log_keep",
        ],
        0,
        ["at iteration 4 (8 samples consumed)"],
    ),
    (
        "interrupted re-save",
        ["--load", "{k}", "--train-iters", "4", "--log-dir", "{d}/log_resave"],
        0,
        [
            "a re-save of that iteration was interrupted: using the copy it replaced",
            "at iteration 4 (8 samples consumed)",
        ],
    ),
    (
        "re-save an iteration",
        ["--load", "{k}", "--save", "{k}", "--save-interval", "2", "--train-iters", "4", "--log-dir", "{k}_log"],
        0,
        ["dropped 2 rows after iteration 2", "successfully saved checkpoint from iteration       4 to {k}"],
    ),
    (
        "exit interval",
        ["--save", "{d}/ckpt_interval", "--exit-interval", "2", "--train-iters", "4", "--log-dir", "{d}/log_interval"],
        0,
        ["exiting program at iteration 2 (--exit-interval 2)"],
    ),
    (
        "disk full",
        ["--save", "{t}/ckpt", "--save-interval", "1", "--train-iters", "3", "--log-dir", "{d}/log_full"],
        2,
        [
            "saving checkpoint at iteration 2 to {t}/ckpt: no space left on the device",
            "The partial {t}/ckpt/iter_0000002.tmp was removed and iteration 1 stays the latest checkpoint",
        ],
    ),
    (
        "resume after disk full",
        ["--load", "{t}/ckpt", "--train-iters", "3", "--log-dir", "{d}/log_full"],
        0,
        ["at iteration 1 (2 samples consumed)"],
    ),
    (
        "exit duration",
        [
            "--save",
            "{d}/ckpt_exit",
            "--exit-duration-in-mins",
            "1e-9",
            "--train-iters",
            "4",
            "--log-dir",
            "{d}/log_exit",
        ],
        0,
        ["exiting program after", "--exit-duration-in-mins 1e-09"],
    ),
]


@pytest.fixture(scope="module")
def world(assets, tmp_path_factory):
    """The checkpoint catalogue, run by one 2-rank world (tests/pretrain_cases.py): {name: [rank results]}."""
    import json

    d, prefix = assets
    tiny = d / "tiny"
    tiny.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(tiny)], capture_output=True, text=True)
    mounted = r.returncode == 0
    cases = []
    for name, argv, _, _ in WORLD:
        if name in ("disk full", "resume after disk full") and not mounted:
            continue
        k = _damaged(d, name, name) if "{k}" in " ".join(argv) else None
        argv = SMALL + ["--data-path", prefix] + [a.format(d=d, p=prefix, k=k, t=tiny) for a in argv]
        if "--log-dir" not in argv:
            argv += ["--log-dir", str(d / "log" / name.replace(" ", "_"))]
        cases.append({"name": name, "argv": argv})
    (d / "cases.json").write_text(json.dumps(cases))
    out = d / "world_out"
    out.mkdir()
    try:
        res = run_ranks(
            2,
            [str(d / "cases.json"), str(out)],
            d,
            timeout=400,
            script=os.path.join(ROOT, "tests", "pretrain_cases.py"),
        )
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(tiny)], capture_output=True)
    assert all(rc == 0 for rc, _, _ in res), [e[-2000:] for _, _, e in res]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks[0]:
        print(f"catalogue world: {res['name']}: exit {res['rc']} after {res['seconds']:.1f} s")
    return {c["name"]: [ranks[0][i], ranks[1][i]] for i, c in enumerate(cases)}, mounted, d, tiny


@pytest.mark.spawn
@pytest.mark.parametrize("name,argv,rc,needles", WORLD, ids=[c[0] for c in WORLD])
def test_checkpoint_and_data_failures(world, name, argv, rc, needles):
    """Each failure: the exit code, the message (path and cause), the same on both ranks, within seconds."""
    results, mounted, d, tiny = world
    if name not in results:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk")
    k = d / "damaged" / name
    for r, res in enumerate(results[name]):
        text = res["stdout"] + res["stderr"]
        assert res["rc"] == rc, (r, res["rc"], text[-3000:])
        if rc == 0 and r > 0:
            continue  # progress lines are rank 0's
        for n in needles:
            assert n.format(d=d, k=k, t=tiny) in text, (r, n, text[-3000:])
        assert res["seconds"] < 60, res["seconds"]
    if rc:
        first = [next(ln for ln in res["stderr"].splitlines() if ln.startswith("error:")) for res in results[name]]
        assert first[0] == first[1], first  # the same message on every rank
        assert "a peer rank died" not in first[0]


def _metrics(path):
    import csv

    with open(path) as f:
        return [r for r in csv.DictReader(f) if r["kind"] == "train"]


def test_schedule_flags_decide_which_schedule_goes_on(world):
    """Extending 4 -> 6 iterations: --override-opt_param-scheduler decays over the new 6 (lr at 5
    above --min-lr); --use-checkpoint-opt_param-scheduler keeps the old end (lr at 5 and 6 is --min-lr)."""
    _, _, d, _ = world
    over = {int(r["iteration"]): float(r["lr"]) for r in _metrics(d / "log_override" / "metrics.csv")}
    keep = {int(r["iteration"]): float(r["lr"]) for r in _metrics(d / "log_keep" / "metrics.csv")}
    assert sorted(over) == sorted(keep) == [5, 6]
    assert keep[5] == keep[6] == pytest.approx(3e-4)
    assert over[5] > 3e-4 * 1.5 and over[6] < over[5]


def test_resave_replaces_the_published_checkpoint_and_keeps_one_row_per_iteration(world):
    _, _, d, _ = world
    k = d / "damaged" / "re-save an iteration"
    assert (k / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in k.iterdir()) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    rows = _metrics(str(k) + "_log/metrics.csv")
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3, 4]
    before = {int(r["iteration"]): float(r["lm_loss"]) for r in _metrics(d / "ckpt_log" / "metrics.csv")}
    for r in rows[2:]:  # iterations 3 and 4 trained again (2 ranks now, 1 before): the same losses
        assert abs(float(r["lm_loss"]) - before[int(r["iteration"])]) <= 1e-5 * before[int(r["iteration"])]


def test_exit_interval_saves_and_exits_at_the_interval(world):
    _, _, d, _ = world
    assert (d / "ckpt_interval" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert [int(r["iteration"]) for r in _metrics(d / "log_interval" / "metrics.csv")] == [1, 2]


def test_disk_full_keeps_the_previous_checkpoint(world):
    results, mounted, d, tiny = world
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk")
    rows = _metrics(d / "log_full" / "metrics.csv")
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3]  # one row per iteration across the resume


def test_exit_duration_saves_the_iteration_it_stops_at(world):
    _, _, d, _ = world
    assert (d / "ckpt_exit" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert [int(r["iteration"]) for r in _metrics(d / "log_exit" / "metrics.csv")] == [1]
