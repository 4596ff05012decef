"""The few-row float32 product of CPU decoding (skinny.c): x (M, K) @ W.T for 2 <= M <= max_rows() rows, on W
packed as (N / 8, K, 8), reading the weights once for every row, where oneDNN's and MKL's GEMMs read them at up to
twice one row's cost (an AVX2 CPU: docs/benchmarks.md, "Few-row products"). drafter.model.linear's product_form
decides per weight shape and row count whether it serves (skinny_rows).

The kernel is C with AVX2 and FMA, compiled on first use with the machine's C compiler ($CC, else cc) into
cache_root()/native/ (about 1 s, once per source and compiler; concurrent builders each write their own file and
rename it into place) and loaded with ctypes. Where the CPU lacks AVX2 or FMA, or no compiler builds it, `library()`
is None and decoding keeps oneDNN's GEMMs."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from drafter.model.config import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("skinny.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
COLS = 8  # skinny.c's COLS: a packed weight's block of output columns
BUILD_TIMEOUT_S = 120


def cpu_takes_it() -> bool:
    """Whether this CPU runs AVX2 and FMA code: torch's own dispatch level says (AVX2 or AVX512 on x86)."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512")


def compiler() -> str | None:
    """The C compiler that builds the kernel: $CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def built_path(cc: str) -> Path:
    """Where the kernel built by `cc` from this source lives: keyed by the source, the compiler and its flags."""
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join((cc, *CFLAGS, platform.machine())).encode()).hexdigest()
    return cache_root() / "native" / f"skinny-{key[:16]}.so"


def build(cc: str) -> Path:
    """Compile skinny.c with `cc` unless built already; returns the shared library's path. Raises RuntimeError
    with the compiler's message when it fails."""
    path = built_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
    try:
        done = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built on first use; None where this CPU or machine cannot run it (logged once)."""
    if not cpu_takes_it():
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler ($CC, cc, gcc): few-row products keep oneDNN")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc)))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("few-row products keep oneDNN: %s", exc)
        return None
    lib.tlt_skinny.restype = ctypes.c_int
    lib.tlt_skinny.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5
    lib.tlt_skinny_max_rows.restype = ctypes.c_int
    lib.max_rows = lib.tlt_skinny_max_rows()  # read once: `takes` asks it on every product
    return lib


def max_rows() -> int:
    """The most rows one call takes (skinny.c's SKINNY_MAX_ROWS); 0 where the kernel is unavailable."""
    lib = library()
    return lib.max_rows if lib is not None else 0


def takes(rows: int, out_features: int, in_features: int) -> bool:
    """Whether the kernel computes a product of this many rows by a weight of this shape."""
    return (1 <= rows <= max_rows() and out_features >= COLS and out_features % COLS == 0
            and in_features >= 2 and in_features % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) float32 as the kernel reads it: (N / 8, K, 8), contiguous (one more copy of the weight)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not takes(1, n, k):
        raise ValueError(f"the few-row kernel takes a CPU float32 weight of N % {COLS} == 0 outputs and an even "
                         f"number of inputs, got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    return weight.detach().reshape(n // COLS, COLS, k).transpose(1, 2).contiguous()


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """add + x (M, K) @ W.T + bias on `pack`'s W: a new (M, N) float32 tensor. At most one of bias and add."""
    lib = library()
    rows, k = x.shape
    n = packed.shape[0] * COLS
    if lib is None or packed.shape[1] != k or not takes(rows, n, k) or x.dtype != torch.float32:
        raise ValueError(f"the few-row kernel does not take {rows} rows of {k} {x.dtype} inputs by a packed "
                         f"{tuple(packed.shape)} weight (kernel {'loaded' if lib is not None else 'unavailable'})")
    for name, t, shape in (("bias", bias, (n,)), ("add", add, (rows, n))):  # the kernel reads them unchecked
        if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"the few-row kernel's {name} must be a CPU float32 tensor of shape {shape}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=torch.float32, device="cpu")
    bias = None if bias is None else bias.contiguous()
    add = None if add is None else add.contiguous()
    rc = lib.tlt_skinny(rows, k, n, x.data_ptr(), packed.data_ptr(), out.data_ptr(),
                        None if bias is None else bias.data_ptr(), None if add is None else add.data_ptr())
    if rc != 0:
        raise ValueError(f"the few-row kernel refused {rows} x {k} by {n} x {k}")
    return out
