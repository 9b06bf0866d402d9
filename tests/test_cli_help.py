"""Help written for users: a real description, and every argument of every command explained with its default and
choices."""

from __future__ import annotations

import argparse
import re

import pytest

from onnx_gtco.cli import main, parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    ap = parser()
    (subs,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs.choices)


def test_top_level_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "run faster in ONNX Runtime on NVIDIA GPUs" in out and "examples:" in out
    for name in _commands():
        assert re.search(rf"^ +{name}\s+\w", out, re.M), f"{name} has no summary line"
    assert "Command line:" not in out  # the module's docstring is not the description


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_argument_has_help_with_its_default(name: str) -> None:
    p = _commands()[name]
    assert p.description, f"{name} --help has no description"
    text = p.format_help()
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        where = f"{name} {'/'.join(a.option_strings) or a.dest}"
        assert a.help and a.help != argparse.SUPPRESS, f"{where} has no help"
        takes_value = a.option_strings and a.nargs != 0
        if takes_value and not a.required:
            assert "default" in a.help, f"{where}: its help does not say the default"
        for choice in a.choices or ():
            assert str(choice) in text, f"{where}: choice {choice} not shown"
