"""The tools are an extra: without it their sub-commands say what to install."""

from __future__ import annotations

import importlib

from tandem.entrypoints import cli


def test_a_tool_without_its_extra_names_the_install(monkeypatch, capsys):
    real = importlib.import_module

    def without_httpx(name, *args):
        if name == "tandem.tools.bench.cli":
            raise ModuleNotFoundError("No module named 'httpx'", name="httpx")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", without_httpx)
    assert cli.main(["bench", "serve", "--base-url", "http://x"]) == 2
    err = capsys.readouterr().err
    assert "tandem[tools]" in err and "httpx" in err
    # the other tools still register in full
    assert cli.build_parser().parse_args(["plan"]).command == "plan"


def test_every_tool_registers_with_the_extra_installed():
    parser = cli.build_parser()
    for name in cli.TOOLS:
        action = next(a for a in parser._subparsers._group_actions if a.choices)
        assert name in action.choices
        assert action.choices[name].add_help  # the real parser, not the placeholder
