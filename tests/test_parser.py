"""The trainer's command line (ulysses_mcore.megatron.trainer.parser): Megatron-LM's names and
defaults (one of each degree, its --seq-length as the position limit), the help text's example kept
on its own lines."""

from ulysses_mcore.megatron.trainer.parser import build_parser


def test_degrees_default_to_one_and_parse_under_megatron_names():
    a = build_parser().parse_args([])
    assert (a.tensor_model_parallel_size, a.ulysses_degree, a.context_parallel_size) == (1, 1, 1)
    assert a.pipeline_model_parallel_size == 1 and a.max_position_embeddings is None
    a = build_parser().parse_args(["--ulysses-degree", "4", "--tensor-model-parallel-size", "2"])
    assert (a.ulysses_degree, a.tensor_model_parallel_size) == (4, 2)


def test_pretrain_help_keeps_its_example_on_separate_lines(capsys):
    from ulysses_mcore.megatron.trainer.pretrain import __doc__ as doc

    text = build_parser(doc).format_help()
    example = [line for line in text.splitlines() if "ulysses-mcore pretrain \\" in line]
    assert example and example[0].rstrip().endswith("\\"), text[:600]
    assert (
        "--tensor-model-parallel-size 2 --ulysses-degree 2"
        in text.split("ulysses-mcore pretrain \\")[1].splitlines()[1]
    )
