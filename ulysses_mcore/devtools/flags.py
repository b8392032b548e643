"""Help lines from a table: every flag of every command gets one (tests/test_flags.py walks them all)."""

from __future__ import annotations

import argparse


def explain(parser: argparse.ArgumentParser, table: dict) -> None:
    """Give each flag of ``parser`` without a help line its line from ``table`` (keyed by its first
    spelling)."""
    for action in parser._actions:
        if action.option_strings and not action.help:
            action.help = table.get(action.option_strings[0])
