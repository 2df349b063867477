"""``tandem serve``'s scale-out flags: clear errors, and no Ray without them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.distributed.config import ReplicaSpec
from tandem.entrypoints.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2", "--prefill-replicas", "1"], "not both"),
    (["--prefill-replicas", "1"], "needs both"),
    (["--decode-replicas", "2"], "needs both"),
    (["--replicas", "-1"], "must be >= 0"),
    (["--replicas", "2", "--num-cpus-per-replica", "0"], "must be positive"),
    (["--replicas", "2", "--max-restarts", "-1"], "must be >= 0"),
    (["--ray-address", "auto"], "needs --replicas"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_roles():
    assert ReplicaSpec(replicas=2).roles == ["replica-0", "replica-1"]
    pd = ReplicaSpec(prefill_replicas=1, decode_replicas=2)
    assert pd.roles == ["prefill-0", "decode-0", "decode-1"] and pd.disaggregated


def test_serve_without_replicas_does_not_import_ray():
    code = ("import sys\n"
            "from tandem.entrypoints import cli\n"
            "from tandem.entrypoints.server import run\n"
            "from tandem.engine import async_engine\n"
            "a = cli.build_parser().parse_args(['serve'])\n"
            "assert cli.spec_from_args(a) is None\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
