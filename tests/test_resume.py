"""Resuming (ulysses_mcore.megatron.trainer.resume): the latest-iteration file read or refused by
name.  Whole save / kill / resume runs:
tests/test_reliability.py."""

import pytest

from ulysses_mcore.megatron.trainer.checkpoint import CheckpointError, latest_file
from ulysses_mcore.megatron.trainer.resume import _read_latest


def test_latest_iteration_file(tmp_path):
    with pytest.raises(CheckpointError, match="is it a checkpoint directory"):
        _read_latest(str(tmp_path))
    with open(latest_file(str(tmp_path)), "w") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        _read_latest(str(tmp_path))
    with open(latest_file(str(tmp_path)), "w") as f:
        f.write("12\n")
    assert _read_latest(str(tmp_path)) == 12


def _manifest(ckpt, files):
    import json
    import zlib

    from ulysses_mcore.megatron.trainer.checkpoint import MANIFEST

    entries = {}
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
        entries[name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (ckpt / MANIFEST).write_text(json.dumps({"format": 1, "iteration": 2, "files": entries}))


def test_damage_is_named_per_file_against_the_manifest(tmp_path):
    """A missing, an empty, a truncated, a grown and a corrupted file, each named with what is wrong;
    a sound checkpoint has no problem (one rank: it checks every file)."""
    from tests.helpers import run_threaded
    from ulysses_mcore.megatron.trainer.resume import _check_files

    names = {n: bytes(range(64)) * 4 for n in ("a", "b", "c", "d", "e", "f")}
    _manifest(tmp_path, names)
    assert run_threaded(1, lambda r, w: _check_files(str(tmp_path)))[0] == []
    (tmp_path / "a").unlink()
    (tmp_path / "b").write_bytes(b"")
    (tmp_path / "c").write_bytes(names["c"][:100])
    (tmp_path / "d").write_bytes(names["d"] + b"x")
    (tmp_path / "e").write_bytes(b"\xff" + names["e"][1:])
    problems = run_threaded(1, lambda r, w: _check_files(str(tmp_path)))[0]
    assert [p.split(": ", 1)[1] for p in problems[:4]] == [
        "missing",
        "empty (0 bytes)",
        "truncated (100 of 256 bytes)",
        "257 bytes, saved as 256",
    ]
    assert len(problems) == 5 and "e: corrupted (CRC-32" in problems[4]


def test_two_ranks_share_the_checking(tmp_path):
    from tests.helpers import run_threaded
    from ulysses_mcore.megatron.trainer.resume import _check_files

    _manifest(tmp_path, dict.fromkeys(("a", "b", "c", "d"), b"x" * 8))
    (tmp_path / "a").unlink()
    (tmp_path / "d").unlink()
    shares = run_threaded(2, lambda r, w: _check_files(str(tmp_path)))
    assert [len(s) for s in shares] == [1, 1] and shares[0][0].endswith("a: missing")  # a on rank 0, d on rank 1


def test_a_checkpoint_without_manifest_or_metadata_is_refused(tmp_path):
    from tests.helpers import run_threaded
    from ulysses_mcore.megatron.trainer.resume import _check_files

    assert run_threaded(1, lambda r, w: _check_files(str(tmp_path)))[0] == [
        f"{tmp_path}/.metadata: missing (not a complete torch_dist checkpoint)"
    ]


def _flags(**over):
    from types import SimpleNamespace

    base = dict(
        use_torch_fsdp2=False,
        bf16=False,
        use_distributed_optimizer=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=None,
    )
    return SimpleNamespace(**(base | over))


LAYOUT_CHANGES = [  # (saved flags, this run's flags, the refusal's words; None: it resumes)
    ({}, {"ulysses_degree": 2}, None),
    ({"use_torch_fsdp2": True}, {"use_torch_fsdp2": True}, None),
    ({"use_torch_fsdp2": True}, {}, "saved with --use-torch-fsdp2 without --bf16"),
    ({}, {"use_torch_fsdp2": True}, "saved without --use-torch-fsdp2 (Megatron's DDP layout); this run is with"),
    ({"use_torch_fsdp2": True, "bf16": True}, {"use_torch_fsdp2": True}, "with --use-torch-fsdp2 and --bf16"),
    ({"use_distributed_optimizer": True}, {}, "saved with --use-distributed-optimizer: resume with it"),
    (
        {"use_distributed_optimizer": True, "num_layers_per_virtual_pipeline_stage": 1},
        {"use_distributed_optimizer": True},
        "--num-layers-per-virtual-pipeline-stage 1 (checkpoint) vs None (now)",
    ),
    ({"num_layers_per_virtual_pipeline_stage": 1}, {"pipeline_model_parallel_size": 1}, None),
]


@pytest.mark.parametrize("saved,now,needle", LAYOUT_CHANGES)
def test_optimizer_layout_changes_resume_or_are_refused_by_name(saved, now, needle):
    """What a resume may change: the degrees of the data-parallel x Ulysses ranks, and the chunking
    without the distributed optimizer; FSDP2's format and precision, and the distributed optimizer's
    tp / pp / chunking, not."""
    from ulysses_mcore.megatron.trainer.resume import _check_optimizer

    args = _flags(**now)
    if needle is None:
        _check_optimizer("ck", vars(_flags(**saved)), args)
        return
    with pytest.raises(CheckpointError, match="--load ck: ") as e:
        _check_optimizer("ck", vars(_flags(**saved)), args)
    assert needle in str(e.value), str(e.value)
