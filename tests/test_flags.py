"""Every flag of every ``ulysses-mcore`` command has a help line (ulysses_mcore.devtools.flags fills them from
each command's table), and ``pretrain --help`` keeps its example's line breaks."""

import argparse
import importlib

import pytest

from ulysses_mcore.cli import COMMANDS


def _parser(name):
    module, _, takes_word = COMMANDS[name]
    if name == "pretrain":
        from ulysses_mcore.megatron.trainer.parser import build_parser

        return build_parser()
    p = importlib.import_module(module).build_parser()
    if takes_word:  # sweep / fit / predict / report: one parser, a sub-parser each
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    return p


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_has_a_help_line(name):
    p = _parser(name)
    bare = [a.option_strings[0] for a in p._actions if a.option_strings and not (a.help or "").strip()]
    assert not bare, f"ulysses-mcore {name}: flags without help: {bare}"
    p.format_help()  # every %(default)s in them formats
