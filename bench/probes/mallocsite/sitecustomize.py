# Experiment only: glibc malloc keeps freed memory (no mmap for < 32 MiB, no trim below 256 MiB) in a
# `vlaserve.cli` process when VLASERVE_EXP_MALLOC is set.
import os
if os.environ.get("VLASERVE_EXP_MALLOC"):
    with open("/proc/self/cmdline", "rb") as f:
        if b"vlaserve.cli" in f.read():
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            assert _libc.mallopt(-3, 32 << 20) == 1 and _libc.mallopt(-1, 256 << 20) == 1
            import sys
            print("sitecustomize: mallopt set", file=sys.stderr)
