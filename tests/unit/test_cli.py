"""The tools are an extra: without it their sub-commands say what to install."""

from __future__ import annotations

import importlib

import pytest

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


def test_engine_flags_are_the_config_fields():
    """One source: every EngineConfig flag parses to that field, default included."""
    from dataclasses import fields

    from tandem.config import EngineConfig, cli_fields

    parser = cli.build_parser()
    a = parser.parse_args(["generate", "hi"])
    assert cli.engine_config_from_args(a) == EngineConfig()
    assert {f.name for f in cli_fields(EngineConfig)} == (
        {f.name for f in fields(EngineConfig)} - {"adaptive_threads", "skip_tokenizer_init"})
    a = parser.parse_args(["generate", "hi", "--no-enable-prefix-caching", "--threads", "3",
                           "-q", "int8", "--max-num-seqs", "7", "--kv-cache-memory", "1GiB"])
    c = cli.engine_config_from_args(a)
    assert (c.enable_prefix_caching, c.num_threads, c.quantization, c.max_num_seqs,
            c.kv_cache_memory) == (False, 3, "int8", 7, 2**30)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 3}, "--block-size must be one of"),
    ({"quantization": "int2"}, "--quantization must be one of"),
    ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1"),
    ({"max_num_seqs": "8"}, "--max-num-seqs must be an integer"),
    ({"num_threads": 0}, "--threads must be >= 1"),
])
def test_config_names_the_flag_in_errors(kwargs, message):
    from tandem.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_an_unusable_cache_folder_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    """TANDEM_CACHE under a file (or anywhere unwritable): one line naming the fix, no
    traceback."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "afile" / "cache"))
    assert cli.main(["generate", "--max-tokens", "1", "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem generate: error: cannot create the cache folder")
    assert "TANDEM_CACHE" in err and err.count("\n") == 1


def test_python_dash_m_tandem_is_the_command():
    """Where the ``tandem`` script is not on PATH (a venv not activated)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tandem", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--reasoning-parser" in out.stdout
