"""The trainer's command line (ulysses_mcore.megatron.trainer.parser): Megatron-LM's names and
defaults (one of each degree, its --seq-length as the position limit), the help text's example kept
on its own lines; the run's configuration as one frozen, typed record."""

import pytest

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


def _megatron_lm_parser():
    """Megatron-LM's own argument parser (megatron.training), or skip where it does not import."""
    import argparse

    import pytest

    try:
        from megatron.training.arguments import add_megatron_arguments
    except Exception as e:  # noqa: BLE001 - the 0.19 wheel ships megatron.training; 0.16 leaves it to the checkout
        pytest.skip(f"megatron.training does not import here: {type(e).__name__}: {e}")
    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


OURS_ALONE = {  # the trainer's flags Megatron-LM does not have: this project's features and conveniences
    "--ulysses-degree",
    "--loss-chunk-tokens",
    "--mlp-chunk-tokens",
    "--offload-activation-checkpoints",
    "--dynamic-ulysses",
    "--dynamic-bucket",
    "--dynamic-calibration",
    "--calibration",
    "--timing",
    "--log-dir",
    "--on-nan",
}


OTHER_VALUES = {  # Megatron-LM's flags the trainer takes with values of its own, and why
    "--attention-backend": {"sdpa", "te"},  # the kernel inside Ulysses' exchange (torch's SDPA, TE's), not Megatron's
    "--tokenizer-type": {"ByteTokenizer"},  # the one tokenizer that needs no download (the embedded corpus)
}


def test_flags_megatron_lm_also_has_mean_the_same_there():
    """Megatron-LM's parser as the reference: a flag of the trainer that Megatron-LM defines is a switch
    where it is one there and a value where it takes one, and its choices are a subset of Megatron-LM's."""
    theirs = {s: a for a in _megatron_lm_parser()._actions for s in a.option_strings}
    ours = {s: a for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    differ = []
    for flag, a in ours.items():
        m = theirs.get(flag)
        if m is None:
            continue
        if (a.nargs == 0) != (m.nargs == 0):
            differ.append(f"{flag}: a switch in one, a value in the other")
        elif a.choices and m.choices:
            extra = set(a.choices) - {getattr(c, "name", c) for c in m.choices} - OTHER_VALUES.get(flag, set())
            if extra:  # Megatron-LM's enums (AttnBackend) by their names
                differ.append(f"{flag}: choices {sorted(extra)} not in Megatron-LM's")
    assert not differ, differ
    alone = set(ours) - set(theirs)
    assert alone == OURS_ALONE, f"not Megatron-LM's: name them as Megatron-LM does, or list them: {sorted(alone)}"


def test_the_run_configuration_is_one_frozen_typed_record():
    """trainer_config: every flag a field under its Megatron-LM name with the parsed value, typed as the
    parser reads it (an int flag int, a switch bool, an optional one Optional), and frozen."""
    import dataclasses
    from typing import Optional

    from ulysses_mcore.megatron.trainer.parser import build_parser, trainer_config

    args = build_parser().parse_args(["--seq-length", "96", "--ulysses-degree", "2", "--bf16"])
    cfg = trainer_config(args)
    assert vars(cfg) == vars(args)
    types = {f.name: f.type for f in dataclasses.fields(cfg)}
    assert types["seq_length"] in (int, Optional[int]) and types["ulysses_degree"] is int
    assert types["bf16"] is bool and types["load"] == Optional[str]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_length = 128
    assert type(trainer_config(args)) is type(cfg)  # one record class for the same flags
