"""megatron_patches: tested with megatron-core alone; against Megatron-LM when importable."""

import argparse
import importlib.util

import pytest
import torch

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
    args = argparse.Namespace(
        ulysses_degree=3,
        context_parallel_size=1,
        num_attention_heads=4,
        num_query_groups=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        seq_length=96,
    )
    with pytest.raises(ValueError, match="--ulysses-degree 3"):
        megatron_patches.fold_args(args)


def test_dynamic_ulysses_is_refused_with_the_trainer_to_use_instead():
    p = megatron_patches.add_ulysses_args(argparse.ArgumentParser())
    args = p.parse_args(["--ulysses-degree", "2", "--dynamic-ulysses"])
    with pytest.raises(ValueError) as e:
        megatron_patches.fold_args(args)
    msg = str(e.value)
    assert "--dynamic-ulysses does not run through Megatron-LM's pretrain_gpt.py" in msg
    assert "ulysses-mcore pretrain --ulysses-degree U --dynamic-ulysses" in msg


def test_apply_swaps_specs_and_remove_restores():
    from megatron.core.models.gpt import gpt_layer_specs as g

    from ulysses_mcore import UlyssesAttention

    before = g.get_gpt_layer_local_spec
    megatron_patches.apply()
    megatron_patches.apply()  # idempotent
    try:
        assert megatron_patches.is_applied()
        core = g.get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention
        assert getattr(core, "module", core) is not UlyssesAttention  # no --ulysses-degree: untouched
        args = argparse.Namespace(
            ulysses_degree=2,
            context_parallel_size=1,
            num_attention_heads=4,
            num_query_groups=4,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            seq_length=64,
        )
        megatron_patches.fold_args(args)
        spec = g.get_gpt_layer_local_spec()
        assert spec.submodules.self_attention.submodules.core_attention.module is UlyssesAttention
        assert getattr(g.get_gpt_layer_local_spec, "__wrapped__", None) is before
    finally:
        megatron_patches.remove()
    megatron_patches.remove()
    assert g.get_gpt_layer_local_spec is before and not megatron_patches.is_applied()
    core = g.get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention
    assert getattr(core, "module", core) is not UlyssesAttention


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="Megatron-LM's megatron.training is not installed (only megatron-core is on PyPI)",
)
def test_against_megatron_lm_validate_args():
    from megatron.training import arguments

    megatron_patches.apply()
    try:
        assert getattr(arguments.validate_args, "_ulysses", False)
    finally:
        megatron_patches.remove()


def test_launch_needs_megatron_lm(capsys, tmp_path):
    from megatron_patches import launch

    assert launch.main(["not_here/pretrain_gpt.py"]) == 2
    assert "not_here/pretrain_gpt.py: no such script" in capsys.readouterr().err
    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("Megatron-LM present: the launcher would run it")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert launch.main([str(script), "--ulysses-degree", "2"]) == 2
    assert "megatron.training is not importable: put Megatron-LM's folder on PYTHONPATH" in capsys.readouterr().err


_CPU_COMPAT_CHECK = r"""
import torch
import megatron.training.initialize as init
import megatron.training.arguments as arguments
import megatron.training.training as training
from ulysses_mcore.megatron.compat import cpu_compat

before = {name: getattr(init, name) for name in ("initialize_megatron", "_initialize_distributed",
                                                   "_set_random_seed", "_warmup_jit_function")}
before_stream = torch.cuda.current_stream
assert not torch.cuda.is_available()
assert cpu_compat.apply_megatron_lm() is True and cpu_compat.apply_megatron_lm() is True  # idempotent
# 6: initialize_megatron is called with allow_no_cuda=True (training.py's by-name import too)
assert init.initialize_megatron.__wrapped__ is before["initialize_megatron"]
assert training.initialize_megatron is init.initialize_megatron
assert cpu_compat._allow_no_cuda(lambda **k: k)(allow_no_cuda=False) == {"allow_no_cuda": True}
# 7: one device inside _initialize_distributed / _set_random_seed only
assert cpu_compat._with_one_device(lambda: torch.cuda.device_count())() == 1 and torch.cuda.device_count() == 0
cpu_compat._with_one_device(lambda: torch.cuda.set_device(3))()  # a no-op inside
assert init._set_random_seed.__wrapped__ is before["_set_random_seed"]
# 8: no fused-kernel build, no CUDA warm-up
try:
    import megatron.legacy.fused_kernels as fk  # Megatron-LM 0.16; the 0.19 wheel has no legacy kernels
except ImportError:
    fk = None
assert (fk is None or fk.load(None) is None) and init._warmup_jit_function() is None
# 9: no CUDA architecture
assert arguments.get_device_arch_version() == 0
# 5: streams and events are torch's CPU stand-ins
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    x = torch.ones(3) * 2
torch.cuda.current_stream().wait_stream(side)
torch.cuda.Event().record()
cpu_compat.remove()
assert all(getattr(init, n) is f for n, f in before.items()) and torch.cuda.current_stream is before_stream
assert torch.cuda.device_count() == 0 and not cpu_compat.active()
print("CPU-COMPAT-OK")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU adaptations are not installed where CUDA is")
def test_cpu_compat_for_megatron_lm_each_shim():
    import os
    import subprocess
    import sys

    mlm = os.environ.get("MEGATRON_LM", "")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (mlm, os.getcwd()) if p))
    probe = subprocess.run(
        [sys.executable, "-c", "import megatron.training.initialize"], env=env, capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(
            "Megatron-LM's megatron.training is not importable (set $MEGATRON_LM): "
            + probe.stderr.strip().splitlines()[-1]
        )
    r = subprocess.run([sys.executable, "-c", _CPU_COMPAT_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "CPU-COMPAT-OK" in r.stdout, r.stderr[-3000:]
