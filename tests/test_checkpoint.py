"""ulysses_mcore.megatron.trainer.checkpoint: what can be checked without a world -- the schedule a
command line asks for (the latest-iteration file and the metrics on resume: tests/test_resume.py).  Saving,
damage detection and resuming run in spawned worlds: tests/test_catalogue.py, tests/test_reliability.py."""

import argparse


from ulysses_mcore.megatron.trainer.checkpoint import (
    schedule_from_flags,
)


def test_schedule_counts_samples():
    a = argparse.Namespace(
        global_batch_size=8,
        lr=1e-3,
        min_lr=1e-4,
        lr_warmup_iters=2,
        train_iters=10,
        lr_decay_style="cosine",
        weight_decay=0.1,
    )
    s = schedule_from_flags(a)
    assert (s["lr_warmup_steps"], s["lr_decay_steps"], s["max_lr"]) == (16, 80, 1e-3)


def test_names_of_the_checkpoint_layout():
    from ulysses_mcore.megatron.trainer.checkpoint import flag_of, iter_dir, latest_file

    assert iter_dir("/ck", 12) == "/ck/iter_0000012" and latest_file("/ck") == "/ck/latest_checkpointed_iteration.txt"
    assert flag_of("make_vocab_size_divisible_by") == "--make-vocab-size-divisible-by"


def test_a_full_disk_is_recognised_through_causes_and_torchs_failures():
    import errno

    from ulysses_mcore.megatron.trainer.checkpoint import _is_no_space, first_line

    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = full
    torch_dcp = RuntimeError("CheckpointException ranks:dict_keys([1])")
    torch_dcp.failures = {1: (OSError(errno.EDQUOT, "Disk quota exceeded"), "traceback")}
    assert _is_no_space(full) and _is_no_space(wrapped) and _is_no_space(torch_dcp)
    assert not _is_no_space(RuntimeError("unexpected pos 64 vs 0")) and not _is_no_space(ValueError())
    assert first_line(RuntimeError("one\ntwo")) == "RuntimeError: one" and first_line(ValueError()) == "ValueError"


def test_the_manifest_lists_every_file_but_itself_with_its_crc(tmp_path):
    import zlib

    from ulysses_mcore.megatron.trainer.checkpoint import MANIFEST, _list_files, crc32

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.distcp").write_bytes(b"weights" * 1000)
    (tmp_path / ".metadata").write_bytes(b"meta")
    (tmp_path / MANIFEST).write_text("{}")
    assert _list_files(str(tmp_path)) == [".metadata", "sub/b.distcp"]
    assert crc32(str(tmp_path / "sub" / "b.distcp")) == zlib.crc32(b"weights" * 1000)


def test_a_failed_save_raises_the_same_error_on_every_rank_and_keeps_the_latest(tmp_path):
    from tests.helpers import run_threaded_errors
    from ulysses_mcore.megatron.trainer.checkpoint import CheckpointError, _raise_if_failed, latest_file

    (tmp_path / "iter_0000004.tmp").mkdir()
    with open(latest_file(str(tmp_path)), "w") as f:
        f.write("2")
    bad = {"rank": 1, "what": "OSError: No space left on device", "nospace": True, "free": 1024}

    def rank_fn(rank, world):
        _raise_if_failed([None, bad], str(tmp_path), str(tmp_path / "iter_0000004.tmp"), 4)

    errors = run_threaded_errors(2, rank_fn)
    assert all(isinstance(e, CheckpointError) for e in errors) and str(errors[0]) == str(errors[1])
    assert "no space left on the device (1024 bytes free; rank(s) 1" in str(errors[0])
    assert "iteration 2 stays the latest checkpoint" in str(errors[0]) and not (tmp_path / "iter_0000004.tmp").exists()
