"""The loader's memory: the C heap's free holes handed back to the OS between
layers, and MemoryGuard, which stops a load that cannot fit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tandem.model import loader


@pytest.mark.skipif(loader._malloc_trim() is None, reason="not glibc: nothing to release")
def test_release_free_memory_returns_heap_holes():
    """Freed blocks between blocks still held stay resident in glibc's heap
    (what a layer's temporaries leave between its packed weights) until
    release_free_memory; run in a fresh process so its heap is the test's."""
    script = textwrap.dedent("""
        import ctypes
        from tandem.model.loader import release_free_memory

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]

        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024

        size = 64 * 1024  # under glibc's mmap threshold: from the heap
        blocks = [libc.malloc(size) for _ in range(6000)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for i, b in enumerate(blocks):
            if i % 16:  # every 16th is kept: the holes cannot be trimmed from the top
                libc.free(b)
        before = rss()
        release_free_memory()
        print(before - rss())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    released = int(out.stdout.strip())
    assert released > 200 * 2**20, released  # ~350 MB of the 375 MB freed


def _available(monkeypatch, n: int | None) -> None:
    monkeypatch.setattr(loader, "host_memory", lambda: (1 << 40, n))


def test_guard_refuses_a_kv_pool_beyond_memory_before_anything_loads(monkeypatch):
    _available(monkeypatch, 1 << 30)
    with pytest.raises(ValueError, match=r"KV cache pool \(2.00 GiB\) is larger than the 1.00 GiB"):
        loader.MemoryGuard(2 << 30, 4, "float32", False)


def test_guard_projects_the_layers_to_come(monkeypatch):
    """One layer of four built, 1 GiB each: 4 GiB of layers need not have been
    built to know they do not fit in 3 GiB."""
    _available(monkeypatch, 3 << 30)
    g = loader.MemoryGuard(0, 4, "float32", False)
    g.check()
    g.layer_bytes.append(1 << 30)
    with pytest.raises(ValueError, match=r"about 4.00 GiB as loaded \(float32\).*stopped after 1 "
                                         r"of 4 layers\); quantize it"):
        g.check()


def test_guard_allows_first_layers_larger_than_the_rest(monkeypatch):
    """Q4_K_M's first layers hold more bits (1.27x a plain layer on an 8B): a
    model that fits exactly is not refused on their evidence."""
    plain, big, layers, base, kv = 100 << 20, 127 << 20, 32, 500 << 20, 1 << 30
    sizes = [big] * 4 + [plain] * (layers - 4)
    _available(monkeypatch, base + sum(sizes) + kv)
    g = loader.MemoryGuard(kv, layers, "the file's block formats", True)
    g.base = base
    for s in sizes:
        g.layer_bytes.append(s)
        g.check()
    g.base += 1  # a byte more than there is: refused, whatever the projection
    with pytest.raises(ValueError, match="32 of 32 layers\\); lower --kv-cache-memory to "
                                         "about 1024 MiB$"):
        g.check()
    g.base += kv  # the weights alone do not fit: no pool size helps
    with pytest.raises(ValueError, match="use a smaller model or fewer bits$"):
        g.check()


def test_guard_is_off_where_memory_is_unknown(monkeypatch):
    _available(monkeypatch, None)
    g = loader.MemoryGuard(1 << 50, 1, "float32", False)
    g.layer_bytes.append(1 << 50)
    g.check()
