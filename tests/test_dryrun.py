"""``ulysses-mcore dryrun`` (ulysses_mcore.megatron.trainer.dryrun, cli/dryrun): the trainer's model on fake
CUDA at world 8, a reduced Llama-shaped model, through every route the project takes on CUDA -- SDPA's
flash kernel (ulysses 8, tp 2 x ulysses 4, two pipeline stages), the ring's fused CUDA blocks
(ulysses 4 x ring 2), torch's varlen kernel (--dynamic-ulysses, packed documents) -- with its counted
FLOPs equal to the step-time model's, the plan's peak within 10%, and a planted device mismatch and a
planted host read failing the run by name (negative controls).  flash-attn and Transformer Engine do
not import without CUDA (their routes run on a GPU: tests/test_gpu.py).  Skipped under a CPU-only
torch."""

import pytest

from ulysses_mcore.devtools import fakeworld as fw

pytestmark = pytest.mark.skipif(bool(fw.unavailable()), reason=fw.unavailable() or "-")

MODEL = (
    "--world-size 8 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 2816 --swiglu --normalization RMSNorm "
    "--untie-embeddings-and-output-weights --vocab-size 32000 --seq-length 16384 --max-position-embeddings 16384 "
    "--micro-batch-size 1 --global-batch-size 8 --bf16"
).split()
ROUTES = {  # layout flags -> the forward kernel every attention call must take
    "ulysses 8": ("--ulysses-degree 8", "sdpa-flash"),
    "tp 2 x ulysses 4": ("--tensor-model-parallel-size 2 --ulysses-degree 4", "sdpa-flash"),
    "ulysses 4 x ring 2": ("--ulysses-degree 4 --context-parallel-size 2", "flash-varlen"),
    "ulysses 4 x pp 2": ("--ulysses-degree 4 --pipeline-model-parallel-size 2", "sdpa-flash"),
    "dynamic ulysses": ("--ulysses-degree 8 --dynamic-ulysses --reset-attention-mask", "torch-varlen"),
}


def _args(extra):
    from ulysses_mcore.cli.dryrun import build_parser

    return build_parser().parse_args(MODEL + extra.split())


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_rank_kind_runs_its_route_with_the_models_flops_and_the_plans_memory(route):
    from ulysses_mcore.megatron.trainer import dryrun

    flags, kernel = ROUTES[route]
    args = _args(flags)
    reports = dryrun.run(args, 8)
    assert len(reports) == args.pipeline_model_parallel_size  # one rank kind per pipeline stage
    layers = args.num_layers // args.pipeline_model_parallel_size
    for r in reports:
        calls = r.kernels_forward.get(f"{kernel} (bfloat16)", 0)  # the ring: its blocks, per layer
        assert set(r.kernels_forward) == {f"{kernel} (bfloat16)"} and calls % layers == 0, r.kernels_forward
        assert set(r.kernels_backward) == {f"{kernel} (bfloat16)"}, r.kernels_backward
        assert r.params_gb > 0 and r.activations_gb > 0 and r.all_to_all_gb_per_layer > 0
        if not args.dynamic_ulysses:  # the dynamic cell holds two documents: less causal work than one
            assert r.forward_tflop["attention"] == pytest.approx(r.model_forward_tflop["attention"], rel=0.02)
        if not args.dynamic_ulysses and r is reports[-1]:  # the model counts the output layer (last stage)
            assert r.forward_tflop["total"] == pytest.approx(r.model_forward_tflop["total"], rel=0.02)
        assert r.step_s > 0
    top = max(reports, key=lambda r: r.peak_gb)  # the plan sizes the busiest rank (the last stage: the loss)
    assert abs(top.plan["total_bytes"] / top.peak_gb - 1) < 0.10, [(r.kind, r.peak_gb) for r in reports] + [top.plan]


def test_the_longest_plan_runs_on_fake_cuda_with_every_memory_feature_and_fits(capsys):
    """plan --longest's last line, run as it is: full recompute with the layer inputs offloaded, the
    optimizer on the host, chunked loss and MLP, at the planned length; the last line says it fits
    the preset, the plan did not promise less than the dry run measured, and the host memory the
    dry run measured a node (offloaded inputs, the host optimizer's weights, gradients and moments)
    is the plan's."""
    from ulysses_mcore.cli import dryrun as cli_dryrun
    from ulysses_mcore.cli import plan

    model = "--num-layers 2 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8"
    model += " --ffn-hidden-size 28672 --swiglu --normalization RMSNorm --vocab-size 128256"
    assert plan.main(["--longest", "--preset", "h100", "--world-size", "8", *model.split()]) == 0
    planned_out = capsys.readouterr().out
    planned_host = float(planned_out.split("host memory ")[1].split()[0].replace(",", ""))
    command = planned_out.splitlines()[-1].split()
    assert command[:2] == ["ulysses-mcore", "dryrun"]
    assert cli_dryrun.main(command[2:]) == 0
    out = capsys.readouterr().out
    last = out.splitlines()[-1]
    assert "fits h100: yes" in last, out
    peak = float(last.split("peak ")[1].split()[0])
    planned = float(last.split("(plan ")[1].split()[0])
    assert planned >= peak, last
    host = float(last.split("host memory ")[1].split()[0])
    assert "optimizer 0.00," in out  # Adam's state, its weights and gradients on the host: measured there
    assert host == pytest.approx(planned_host, rel=0.05), (planned_out, out)  # layer inputs, head, Adam


def test_fits_line_keeps_the_allocators_share_free():
    from ulysses_mcore.cli.dryrun import fits_line

    assert fits_line(73.5, "h100") == "fits h100: yes (peak 73.5 of 80 GB, 8% kept free)"
    assert fits_line(73.7, "h100").startswith("fits h100: no")
    assert fits_line(120.0, "h200").startswith("fits h200: yes")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--use-torch-fsdp2"], "--use-torch-fsdp2: the dry run cannot build torch's DeviceMesh"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            "--num-layers-per-virtual-pipeline-stage: the dry run sizes one model chunk a pipeline stage",
        ),
    ],
)
def test_what_the_dry_run_cannot_size_is_refused_with_the_flag_that_stands_in(capsys, flags, needle):
    """torch's DeviceMesh reads its ranks back from a tensor, which fake tensors cannot answer; the
    interleaved schedule's chunks are sized as one: the dry run says so (exit 2) and names the fix."""
    from ulysses_mcore.cli import dryrun as cli_dryrun

    assert cli_dryrun.main(MODEL + ["--ulysses-degree", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
