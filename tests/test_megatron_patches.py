"""megatron_patches: tested with megatron-core alone; against Megatron-LM when importable."""

import argparse
import importlib.util

import pytest

import megatron_patches


def test_fold_args_turns_ulysses_into_context_parallelism():
    p = megatron_patches.add_ulysses_args(argparse.ArgumentParser())
    args = p.parse_args(["--ulysses-degree", "4"])
    args.context_parallel_size, args.num_attention_heads, args.num_query_groups = 2, 32, 8
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.seq_length = 2, 1, 4096
    megatron_patches.fold_args(args)
    assert args.context_parallel_size == 8 and args.hierarchical_context_parallel_sizes == [4, 2]
    megatron_patches.fold_args(args)  # idempotent
    assert args.context_parallel_size == 8
    megatron_patches.remove()


def test_fold_args_rejects_bad_degrees():
    args = argparse.Namespace(ulysses_degree=3, context_parallel_size=1, num_attention_heads=4, num_query_groups=4,
                              tensor_model_parallel_size=2, pipeline_model_parallel_size=1, seq_length=96)
    with pytest.raises(ValueError, match="--ulysses-degree 3"):
        megatron_patches.fold_args(args)


def test_apply_swaps_specs_and_remove_restores():
    from megatron.core.models.gpt import gpt_layer_specs as g

    from ulysses_mcore import UlyssesAttention

    before = g.get_gpt_layer_local_spec
    megatron_patches.apply()
    megatron_patches.apply()  # idempotent
    try:
        assert megatron_patches.is_applied()
        spec = g.get_gpt_layer_local_spec()
        assert spec.submodules.self_attention.submodules.core_attention.module is UlyssesAttention
        assert getattr(g.get_gpt_layer_local_spec, "__wrapped__", None) is before
    finally:
        megatron_patches.remove()
    megatron_patches.remove()
    assert g.get_gpt_layer_local_spec is before and not megatron_patches.is_applied()
    core = g.get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention
    assert getattr(core, "module", core) is not UlyssesAttention


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="Megatron-LM's megatron.training is not installed (only megatron-core is on PyPI)")
def test_against_megatron_lm_validate_args():
    from megatron.training import arguments

    megatron_patches.apply()
    try:
        assert getattr(arguments.validate_args, "_ulysses", False)
    finally:
        megatron_patches.remove()


def test_launch_needs_megatron_lm(capsys):
    from megatron_patches import launch

    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("Megatron-LM present: the launcher would run it")
    assert launch.main(["pretrain_gpt.py", "--ulysses-degree", "2"]) == 2
    assert "megatron.training is not importable" in capsys.readouterr().err
