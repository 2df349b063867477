"""The loader hands the C heap's free holes back to the OS between layers."""

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
