"""tandem's fused CPU kernels (tandem/kernels/csrc/), built once per machine.

The source (cpu_ops.cpp and the headers it includes) is compiled with the
host's g++ against the installed torch's headers (the first time only) into
``$TANDEM_CACHE/kernels`` and loaded as ``torch.ops.tandem.*``.
``-march=native`` is safe because the build runs on the machine that uses it;
the cache key includes the CPU's flags, so a cache directory shared with
another CPU model rebuilds rather than crash.

Every kernel has a torch reference path next to where it is called. When no
compiler is present, the build fails, or ``TANDEM_CUSTOM_OPS=0`` is set, the
reference paths run instead (slower, same results within float rounding) and
one warning says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from tandem.config import cpu_flags
from tandem.paths import cache_root_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_ops.cpp"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off",
         "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-std=c++17",
         "-shared", "-fPIC", "-w"]


def _compile(dest: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-L" + library_paths()[0], "-lc10", "-ltorch_cpu"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, dest)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> bool:
    if os.environ.get("TANDEM_CUSTOM_OPS", "1") == "0":
        return False
    if hasattr(torch.ops, "tandem") and hasattr(torch.ops.tandem, "rms_norm"):
        return True
    sources = b"".join(f.read_bytes() for f in sorted(CSRC.glob("*.[ch]*")))
    key = hashlib.sha256(
        sources + torch.__version__.encode() + " ".join(FLAGS).encode()
        + " ".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    lib = cache_root_dir() / "kernels" / f"cpu_ops-{key}.so"
    try:
        if not lib.exists():
            logger.info("building tandem's CPU kernels (once per machine, ~35 s on 2 cores)")
            _compile(lib)
        torch.ops.load_library(str(lib))
    except (RuntimeError, OSError) as e:
        logger.warning("tandem's fused CPU kernels are unavailable (%s); using the slower "
                       "torch reference paths", e)
        return False
    return True


_available: bool | None = None


def available() -> bool:
    """Whether torch.ops.tandem.* is loaded (callers keep a torch reference path).

    The first call loads the kernels, building them if this machine has none
    yet: importing a module compiles nothing; building a model does.
    """
    global _available
    if _available is None:
        _available = _load()
    return _available


@functools.cache
def simd_features() -> frozenset[str]:
    """The instruction sets the loaded kernels were compiled for, in /proc/cpuinfo's
    names (empty without the kernels): what they run, which the CPU's flags only
    bound."""
    return frozenset(torch.ops.tandem.simd_features().split()) if available() else frozenset()


if __name__ == "__main__":  # `python -m tandem.kernels.custom_ops`: build now (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not available():
        raise SystemExit("tandem's CPU kernels are unavailable; tandem runs, more slowly")
    print(f"tandem's CPU kernels are built ({' '.join(sorted(simd_features())) or 'portable'})")
