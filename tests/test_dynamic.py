"""``--dynamic-ulysses`` end to end (gloo, CPU): the fixed degree's losses and gradient norms over 10
iterations at worlds 2 and 4 (tp 2 in one layout), across a checkpoint saved under one layout and
resumed under the other; refused layouts named before any collective.

Two worlds (tests/pretrain_cases.py: one process per rank serves many trainings): 2 ranks (pure
data parallelism, ulysses 2, dynamic ulysses 2) and 4 ranks (ulysses 4, dynamic 4, tp 2 x ulysses 2,
dynamic tp 2 x 2, and the two resumes).  The data: the seeded long-tailed mix
(:mod:`ulysses_mcore.planning.mix`) with documents of every degree.
"""

import csv
import json
import os
import re

import pytest

from tests.helpers import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(ROOT, "tests", "pretrain_cases.py")
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --seq-length 512 "
    "--micro-batch-size 1 --global-batch-size 4 --train-iters 10 --lr-warmup-iters 1 --lr 3e-3 --seed 7 "
    "--split 100,0,0 --log-interval 1"
).split()
SMALL = BASE + ["--reset-attention-mask"]
RTOL = 1e-5  # fp32 rounding of sums in another order

LEARNED = ["--position-embedding-type", "learned_absolute", "--reset-position-ids", "--max-position-embeddings", "512"]
EVAL = ["--split", "90,10,0", "--eval-interval", "5", "--eval-iters", "1"]
WORLD2 = {
    "u1": ["--ulysses-degree", "1"],
    "u2": ["--ulysses-degree", "2"],
    "dyn2": ["--ulysses-degree", "2", "--dynamic-ulysses"],
    "u2_learned_eval": ["--ulysses-degree", "2", *LEARNED, *EVAL],
    "dyn2_learned_eval": ["--ulysses-degree", "2", "--dynamic-ulysses", *LEARNED, *EVAL],
}
WORLD4 = {
    "u4": ["--ulysses-degree", "4", "--save", "{d}/ckpt_u4", "--save-interval", "5"],
    "dyn4": ["--ulysses-degree", "4", "--dynamic-ulysses", "--save", "{d}/ckpt_dyn4", "--save-interval", "5"],
    "tp2u2": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2"],
    "dyn_tp2u2": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2", "--dynamic-ulysses"],
    "dyn4_from_u4": ["--ulysses-degree", "4", "--dynamic-ulysses", "--load", "{d}/ckpt_u4"],
    "tp2u2_from_dyn4": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2", "--load", "{d}/ckpt_dyn4"],
}  # fmt: skip


def _mix(d) -> str:
    from ulysses_mcore.megatron.trainer.data import read_documents, write_indexed_dataset
    from ulysses_mcore.planning.mix import long_tailed_lengths, write_jsonl

    write_jsonl(str(d / "mix.jsonl"), long_tailed_lengths(400, seed=2, median=90, longest=512, whole_every=9), seed=2)
    write_indexed_dataset(read_documents(str(d / "mix.jsonl")), str(d / "mix"), progress=False)
    return str(d / "mix")


def _world(n, cases, d, prefix):
    listed = []
    for name, argv in cases.items():
        argv = SMALL + ["--data-path", prefix, "--log-dir", str(d / name)] + [a.format(d=d) for a in argv]
        case = {"name": name, "argv": argv}
        if "--load" in argv:  # resume at iteration 5 of the 10 the saving run kept
            ckpt = argv[argv.index("--load") + 1]
            case["write"] = {os.path.join(ckpt, "latest_checkpointed_iteration.txt"): "5"}
        listed.append(case)
    (d / f"cases{n}.json").write_text(json.dumps(listed))
    out = d / f"out{n}"
    out.mkdir()
    res = run_ranks(n, [str(d / f"cases{n}.json"), str(out)], d, timeout=600, script=CASES)
    assert all(rc == 0 for rc, _, _ in res), [e[-3000:] for _, _, e in res]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    for case in ranks[0]:
        print(f"dynamic world {n}: {case['name']}: exit {case['rc']} after {case['seconds']:.1f} s")
    return {c["name"]: [rk[i] for rk in ranks] for i, c in enumerate(listed)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic")
    prefix = _mix(d)
    out = _world(2, WORLD2, d, prefix)
    out.update(_world(4, WORLD4, d, prefix))
    return out, d


def _metrics(d, name):
    """{iteration: (loss, grad norm)} of training rows, {-iteration: (validation loss,)} of validation rows."""
    with open(d / name / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    out = {int(r["iteration"]): (float(r["lm_loss"]), float(r["grad_norm"])) for r in rows if r["kind"] == "train"}
    out.update({-int(r["iteration"]): (float(r["lm_loss"]),) for r in rows if r["kind"] == "valid"})
    return out


def _same(got, want):
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for it in want:
        for a, b in zip(got[it], want[it]):
            assert abs(a - b) <= RTOL * abs(b), (it, got[it], want[it])


@pytest.mark.spawn
@pytest.mark.parametrize(
    "dynamic,fixed",
    [
        ("dyn2", "u2"),
        ("dyn2", "u1"),
        ("dyn2_learned_eval", "u2_learned_eval"),  # learned absolute positions; validation losses too
        ("dyn4", "u4"),
        ("dyn_tp2u2", "tp2u2"),
        ("dyn4", "tp2u2"),
    ],
)
def test_dynamic_gives_the_fixed_degrees_losses_and_gradient_norms(runs, dynamic, fixed):
    results, d = runs
    for name in (dynamic, fixed):
        assert all(r["rc"] == 0 for r in results[name]), [r["stderr"][-2000:] for r in results[name]]
    got = _metrics(d, dynamic)
    _same(got, _metrics(d, fixed))
    assert sorted(it for it in got if it > 0) == list(range(1, 11))
    if "eval" in dynamic:
        assert sorted(it for it in got if it < 0) == [-10, -5]


@pytest.mark.spawn
def test_documents_really_run_at_several_degrees_and_the_scheduler_is_cheap(runs):
    results, _ = runs
    text = results["dyn4"][0]["stdout"]
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("dynamic:")]
    assert len(lines) == 10, text[-2000:]
    degrees = set()
    for ln in lines:
        degrees |= {int(k) for k in re.findall(r"(\d+): \d+", ln.split("documents by degree")[1].split("|")[0])}
        share = float(re.search(r"\(([\d.]+)% of the step\)", ln).group(1))
        assert share < 2.0, ln
    assert degrees == {1, 2, 4}, lines
    assert "--dynamic-ulysses: a degree per document from 1 to 4" in text


@pytest.mark.spawn
@pytest.mark.parametrize("resumed,full", [("dyn4_from_u4", "u4"), ("tp2u2_from_dyn4", "dyn4")])
def test_a_checkpoint_resumes_under_the_other_layout(runs, resumed, full):
    results, d = runs
    assert "resumed from" in results[resumed][0]["stdout"]
    got, want = _metrics(d, resumed), _metrics(d, full)
    assert sorted(got) == [6, 7, 8, 9, 10]
    _same(got, {it: want[it] for it in got})


DYN = ["--ulysses-degree", "2", "--dynamic-ulysses", "--reset-attention-mask"]
REFUSED = [
    (["--ulysses-degree", "2", "--dynamic-ulysses"], "needs --reset-attention-mask"),
    (
        ["--ulysses-degree", "2", "--dynamic-ulysses", "--reset-attention-mask", "--pipeline-model-parallel-size", "2"],
        "--dynamic-ulysses runs with --pipeline-model-parallel-size 1 and --context-parallel-size 1, not 2 and 1",
    ),
    (
        ["--ulysses-degree", "1", "--context-parallel-size", "2", "--dynamic-ulysses", "--reset-attention-mask"],
        "not 1 and 2",
    ),
    (DYN + ["--attention-backend", "te"], "sdpa or flash"),
    (DYN + ["--dynamic-bucket", "0"], "--dynamic-bucket"),
    (DYN + ["--calibration", "/nonexistent/cal.json"], "--calibration /nonexistent/cal.json: no such file"),
    (DYN + ["--dynamic-calibration", os.path.join(ROOT, "README.md")], "README.md: unreadable"),
]  # fmt: skip


@pytest.mark.parametrize("args,needle", REFUSED, ids=[" ".join(a[2:]) for a, _ in REFUSED])
def test_layouts_it_does_not_run_are_refused_before_any_collective(args, needle, monkeypatch, capsys):
    from ulysses_mcore.megatron.trainer import pretrain

    monkeypatch.setenv("WORLD_SIZE", "4" if "--pipeline-model-parallel-size" in args else "2")
    rc = pretrain.main(BASE + args)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


def test_ulysses_degree_that_is_not_a_power_of_two_is_refused(monkeypatch, capsys):
    from ulysses_mcore.megatron.trainer import pretrain

    monkeypatch.setenv("WORLD_SIZE", "6")
    rc = pretrain.main(
        ["--num-attention-heads", "6", "--hidden-size", "96", "--seq-length", "96", "--global-batch-size", "6"]
        + ["--ulysses-degree", "6", "--dynamic-ulysses", "--reset-attention-mask"]
    )
    assert rc == 2 and "power of two" in capsys.readouterr().err


def test_bucket_is_a_sixteenth_of_the_load_and_a_multiple_of_tp_under_sequence_parallel():
    import argparse

    from ulysses_mcore.megatron.trainer.dynamic import bucket_of

    def args(**kw):
        return argparse.Namespace(
            **{"dynamic_bucket": None, "sequence_parallel": False, "tensor_model_parallel_size": 1, **kw}
        )

    assert bucket_of(args(), 1024) == (16, 1) and bucket_of(args(dynamic_bucket=10), 1024) == (10, 1)
    assert bucket_of(args(dynamic_bucket=10, sequence_parallel=True, tensor_model_parallel_size=4), 1024) == (20, 4)
    assert bucket_of(args(sequence_parallel=True, tensor_model_parallel_size=8), 1000) == (16, 8)
