"""ulysses_mcore.megatron.trainer.arguments: the trainer's flags, checked in one place before any work
(ranges first, then the layout, then the rules between flags), each error naming the flag and the fix.
The full catalogue of bad command lines, run through the trainer, is tests/test_catalogue.py."""

import pytest

from ulysses_mcore.megatron.trainer.arguments import padded_vocab, parse_split, validate
from ulysses_mcore.megatron.trainer.parser import build_parser

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "4",
]


def _args(*extra):
    return build_parser().parse_args(TINY + list(extra))


def test_a_good_command_line_gives_the_layout():
    topo = validate(_args("--ulysses-degree", "2"), 4)
    assert (topo.ulysses, topo.dp) == (2, 2)


@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (
            ["--global-batch-size", "3"],
            2,
            "--global-batch-size 3 must be a multiple of --micro-batch-size 1 x data-parallel size 2",
        ),
        (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr 1.0 is above --lr 0.1"),
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3 must be divisible"),
        (["--save-interval", "2"], 1, "--save-interval needs --save"),
        (["--lr-warmup-iters", "4"], 1, "--lr-warmup-iters 4 must be < --train-iters 4: pass --lr-warmup-iters 3"),
        (["--ulysses-degree", "8"], 8, "--ulysses-degree 8 does not fit 4 query / 4 kv heads"),
        (["--ulysses-degree", "3"], 3, "--seq-length 32 must be divisible by ulysses"),
        (["--vocab-size", "100"], 1, "--vocab-size 100 is below the byte tokenizer's 258 ids"),
    ],
)
def test_rules_name_the_flag(extra, world, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        validate(_args(*extra), world)


def test_split_and_vocab():
    assert parse_split("98,2") == [98.0, 2.0, 0.0] and parse_split("8/1/1") == [8.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="--split a,b"):
        parse_split("a,b")
    args = _args("--make-vocab-size-divisible-by", "128")
    assert padded_vocab(args) % 128 == 0 and padded_vocab(args) >= 258  # the byte tokenizer's 258 ids
    assert padded_vocab(_args("--vocab-size", "128256")) == 128256  # Llama 3's, a multiple of 128 already
    assert padded_vocab(_args("--vocab-size", "1000", "--make-vocab-size-divisible-by", "64")) == 1024
    from ulysses_mcore.megatron.trainer.data import ByteTokenizer

    assert padded_vocab(_args("--make-vocab-size-divisible-by", "1")) == ByteTokenizer().vocab_size
