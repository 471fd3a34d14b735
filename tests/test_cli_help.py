"""``dynatrain COMMAND --help`` says the default of every flag that has one.

Oracle: the parser's own actions (each flag's default), read independently of the help text.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from ds_dynatrain.cli.main import build_parser


def _commands():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_names_every_default(name):
    parser = _commands()[name]
    text = " ".join(parser.format_help().split())  # the formatter wraps lines
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if any(action.default is d for d in (None, False, argparse.SUPPRESS)):
            continue  # nothing to say: no default, or a switch that is off
        flag = action.option_strings[-1]
        entry = text.split(flag, 2)[-1].split(" --", 1)[0]  # the flag's own help entry
        assert "default" in entry, (name, flag, entry)
        if "default" not in (action.help or ""):  # the formatter's words, the parser's value
            assert f"(default: {action.default})" in entry, (name, flag, entry)


def test_resize_help_shows_its_timeout():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["resize", "--help"])
    assert "(default: 600.0)" in " ".join(out.getvalue().split())
