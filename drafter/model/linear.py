"""CPU inference's linear layers: oneDNN's packed GEMMs (flat in rows, what a verify's several rows run on), a
one-row product as MKL's GEMV where that is timed faster (plain decoding of one sequence), a few rows on the few-row
kernel where that is (drafter.model.skinny), a draft head's products on int8 copies of its weights where that is
(drafter.model.int8); and whether a device has bf16 units. Training, GPUs and other dtypes run plain F.linear."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from drafter.model import skinny
from drafter.model.int8 import int8_linear_available, int8_prepack, int8_product


@functools.cache
def onednn_linear_available() -> bool:
    """Whether CPU float32 inference runs its linear layers on oneDNN with pre-packed weights.

    On this project's reference CPU (AMD EPYC, MKL 2024) MKL's sgemm with 2-7 rows costs 2-3x one
    row, so verifying k drafts cost up to 2.3x a plain decode step; oneDNN with packed weights is
    flat from 1 to 6 rows and 1.6x faster at one row (docs/benchmarks.md, "Engine"); where MKL's GEMV
    is faster at one row still (an AVX2 EPYC with slow memory), one_row_form takes it for one-row products.
    Set TLT_CPU_LINEAR=mkl to turn oneDNN off."""
    if os.environ.get("TLT_CPU_LINEAR", "onednn").lower() == "mkl":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matmuls run natively on `device`: a CUDA GPU with bf16, or a CPU with AVX512-BF16
    or AMX tiles (elsewhere torch emulates them, slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private in torch 2.x: probe gently
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


@functools.cache
def native_cpu_bf16() -> bool:
    """fast_bf16("cpu"), asked once: oneDNN packs bf16 weights only where the CPU has bf16 units."""
    return fast_bf16("cpu")


# the number of rows oneDNN packs a weight for (its batch-size hint; None: any). On a 2-core AVX2 EPYC at one thread,
# SmolLM2's forward at 16 decoding rows took 131.8 ms packed for 4 against 142.5 ms for any (min of 3, same
# process, interleaved), and the same within noise at 1 to 4 rows and at prefill's hundreds
PACK_HINT_ROWS = 4


def _weight_key(weight: torch.Tensor) -> tuple:
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: it cannot be updated in place, so never stale
        version = -1
    return id(weight), weight.data_ptr(), version


class PackedWeight:
    """A weight's oneDNN-packed copy and, where one-row products run as a GEMV over it (`one_row_form`), its
    transposed copy; each rebuilt whenever the weight is replaced or updated in place (a policy weight sync, an
    optimizer step). Never pickled or copied: it is a cache."""

    __slots__ = ("key", "packed", "t_key", "t", "q_key", "q", "s_key", "s")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.t_key: tuple | None = None
        self.t: torch.Tensor | None = None
        self.q_key: tuple | None = None
        self.q = None  # int8_prepack's packed parameters
        self.s_key: tuple | None = None
        self.s: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _weight_key(weight)
        if key != self.key:
            self.packed, self.key = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS), key
        return self.packed

    def transposed(self, weight: torch.Tensor) -> torch.Tensor:
        """weight.T (in, out), contiguous: the layout whose one-row product is MKL's streaming GEMV."""
        key = _weight_key(weight)
        if key != self.t_key:
            self.t, self.t_key = weight.detach().t().contiguous(), key
        return self.t

    def int8(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """The weight's int8 copy (int8_prepack), rebuilt when the weight changes: a product of `int8_product`."""
        key = (_weight_key(weight), None if bias is None else _weight_key(bias))
        if key != self.q_key:
            self.q, self.q_key = int8_prepack(weight, bias), key
        return self.q

    def skinny(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the few-row kernel reads it (drafter.model.skinny.pack), rebuilt when the weight changes."""
        key = _weight_key(weight)
        if key != self.s_key:
            self.s, self.s_key = skinny.pack(weight), key
        return self.s


def fastest_seconds(forms: dict, rounds: int = 3) -> dict:
    """{name: seconds}: the fastest of `rounds` interleaved timed calls of each form (a busy moment slows one round,
    not a form): how one_row_form and draft_int8_pays compare theirs."""
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(rounds):
        for name, form in forms.items():
            t0 = time.perf_counter()
            form()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# How a one-row CPU float32 product x @ W.T runs (one_row_form): on oneDNN's packed weight (flat in rows, what a
# verify's several rows run on), as MKL's GEMV over W's transposed copy (PackedWeight.transposed: one more copy of
# the weight), as MKL's GEMV along W's rows (F.linear, no copy), or on the few-row kernel (drafter.model.skinny)
ONE_ROW_FORMS = ("onednn", "transposed", "rows", "skinny")
# the weight bytes one_row_form streams per form and round: past a CPU's last-level cache, as a decode step reads
# its weights (SmolLM2-135M's are 540 MB in float32)
ONE_ROW_PROBE_BYTES = 64 << 20
ONE_ROW_PROBE_COPIES = 256  # at most this many copies: a tiny model's weights sit in the caches anyway
ONE_ROW_MARGIN = 1.1  # a GEMV must be this much faster than oneDNN: a near tie keeps oneDNN
# a weight of at most this many bytes is not timed: it sits in a core's L2 cache, where a product costs its call,
# not its reads, and timing it would cost a process about a second a shape (a tiny model's job worker paid 5-8 s).
# It takes what the probes chose for such shapes on a 2-core AVX2 EPYC (64 x 64: oneDNN 48 us a product, the
# kernel 15, MKL over the transposed copy 5 at one row; 13, 40 and 9 at 3 rows): one row as "transposed", 2 or
# more rows on the few-row kernel where it takes the shape. It is the size below which the probes could not stream
# ONE_ROW_PROBE_BYTES in ONE_ROW_PROBE_COPIES copies (256 KB); SmolLM2-135M's smallest weight (k/v, 192 x 576) is 442 KB
SMALL_WEIGHT_BYTES = ONE_ROW_PROBE_BYTES // ONE_ROW_PROBE_COPIES


def small_weight(out_features: int, in_features: int) -> bool:
    """Whether a float32 weight of this shape is at most SMALL_WEIGHT_BYTES: one the probes do not time."""
    return out_features * in_features * 4 <= SMALL_WEIGHT_BYTES


def probe_copies(out_features: int, in_features: int, least: int = 1) -> int:
    """How many float32 copies of a weight of this shape the probes stream: ONE_ROW_PROBE_BYTES, at least `least`,
    at most ONE_ROW_PROBE_COPIES."""
    return min(ONE_ROW_PROBE_COPIES, max(least, ONE_ROW_PROBE_BYTES // (out_features * in_features * 4)))


def onednn_probe(out_features: int, in_features: int) -> tuple[torch.Tensor, Callable]:
    """(weights, onednn): probe_copies' float32 copies of a weight of this shape (a product's time is not the
    values'), and onednn(x), a form for fastest_seconds that multiplies x by every copy on oneDNN's packed GEMM, as
    `linear` runs it. Call in inference mode."""
    weights = torch.full((probe_copies(out_features, in_features), out_features, in_features), 1e-3, device="cpu")
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in weights]
    return weights, lambda x: lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]


@functools.cache
def one_row_form(dtype: torch.dtype, out_features: int, in_features: int) -> str:
    """Which of ONE_ROW_FORMS a one-row CPU product of this shape runs as: timed once per (dtype, shape) and process,
    over cold weights, the fastest of the others where it beats oneDNN by ONE_ROW_MARGIN ("transposed", untimed, for a
    small_weight). float32 only (bf16 rows keep oneDNN, whose row blocks pair a verify with plain decoding to the bit:
    drafter.decode.projections). Decoding one row reads every weight for one row of output, so it is bound by memory: on
    a 2-core AVX2 EPYC (about 5 GB/s) oneDNN's packed kernel read SmolLM2's weights at about half the speed of MKL's
    GEMV (the LM head 19.6 against 10.5 ms transposed; the down projection 0.83 against 0.43 ms along its rows), while
    on earlier boxes oneDNN had been the faster at one row (docs/benchmarks.md, "One-row products"); the few-row kernel
    read the q/k/v, o and down projections faster still there (150 against 175 us for q/k/v). TLT_CPU_ONE_ROW=auto (the
    default) times it; onednn, transposed, rows or skinny forces that form (skinny where the kernel takes the shape)."""
    mode = os.environ.get("TLT_CPU_ONE_ROW", "auto").lower()
    if mode not in ("auto", *ONE_ROW_FORMS):
        raise ValueError(f"TLT_CPU_ONE_ROW must be auto or one of {', '.join(ONE_ROW_FORMS)}, got {mode!r}")
    if dtype != torch.float32 or not onednn_linear_available():
        return "onednn"
    kernel = skinny.takes(1, out_features, in_features)
    if mode == "skinny" and not kernel:
        raise ValueError(f"TLT_CPU_ONE_ROW=skinny: the few-row kernel does not take a {out_features} x {in_features} "
                         "weight here (it needs an AVX2 CPU, a C compiler, outputs in 8s and an even input count)")
    if mode != "auto":
        return mode
    if small_weight(out_features, in_features):
        return "transposed"
    with torch.inference_mode():
        weights, onednn = onednn_probe(out_features, in_features)
        copies = torch.full((len(weights), in_features, out_features), 1e-3, device="cpu")
        x = torch.full((1, in_features), 1e-3, device="cpu")
        forms = {"onednn": onednn(x),
                 "transposed": lambda: [torch.mm(x, t) for t in copies],
                 "rows": lambda: [F.linear(x, w) for w in weights]}
        if kernel:
            kernels = [skinny.pack(w) for w in weights]
            forms["skinny"] = lambda: [skinny.product(x, k) for k in kernels]
        best = fastest_seconds(forms)
    fastest = min(best, key=best.get)
    return fastest if best[fastest] * ONE_ROW_MARGIN < best["onednn"] else "onednn"


# skinny_rows: the few-row kernel serves a product of 2 or more rows where it is this much faster than oneDNN
SKINNY_MARGIN = 1.1
SKINNY_MODES = ("auto", "on", "off")


@functools.cache
def skinny_rows(dtype: torch.dtype, out_features: int, in_features: int) -> frozenset[int]:
    """The row counts (2 to skinny.max_rows()) at which a CPU float32 product of this shape runs on the few-row kernel
    (drafter.model.skinny): timed once per shape and process against oneDNN's packed GEMM over cold weights, as
    one_row_form times one row; those where it is SKINNY_MARGIN faster (every count, untimed, for a small_weight). A
    decode step of a few rows (a verify's k + 1 tokens of a row or two, plain decoding of a few rows) is bound by
    reading the weights: on a 2-core AVX2 EPYC oneDNN read SmolLM2's LM head at 3 rows in 11.0 ms and at 8 in 14.1, the
    kernel in 7.7 and 11.1, one row's GEMV in 6.0 (docs/benchmarks.md, "Few-row products"). Empty for other dtypes (bf16
    keeps oneDNN's row blocks), without oneDNN or the kernel. TLT_CPU_SKINNY=auto (the default) times it; on takes every
    count the kernel does, off none."""
    mode = os.environ.get("TLT_CPU_SKINNY", "auto").lower()
    if mode not in SKINNY_MODES:
        raise ValueError(f"TLT_CPU_SKINNY must be one of {', '.join(SKINNY_MODES)}, got {mode!r}")
    counts = range(2, skinny.max_rows() + 1)
    if (mode == "off" or dtype != torch.float32 or not onednn_linear_available()
            or not skinny.takes(2, out_features, in_features)):
        return frozenset()
    if mode == "on" or small_weight(out_features, in_features):
        return frozenset(counts)
    with torch.inference_mode():
        weights, onednn = onednn_probe(out_features, in_features)
        kernels = [skinny.pack(w) for w in weights]
        takes = set()
        for rows in counts:
            x = torch.full((rows, in_features), 1e-3, device="cpu")
            best = fastest_seconds({"onednn": onednn(x),
                                    "skinny": lambda x=x: [skinny.product(x, k) for k in kernels]})
            if best["skinny"] * SKINNY_MARGIN < best["onednn"]:
                takes.add(rows)
    return frozenset(takes)


def product_forms(dtype: torch.dtype, shapes) -> tuple[tuple[str, frozenset[int]], ...]:
    """(one_row_form, skinny_rows) for each weight shape (out, in): what a runner or a drafter asks when it is built,
    so that no decode step times the probes."""
    return tuple((one_row_form(dtype, *shape), skinny_rows(dtype, *shape)) for shape in shapes)


def product_form(x: torch.Tensor, weight: torch.Tensor) -> str:
    """How a CPU product of x (N, in) by weight runs: one_row_form's choice where N is 1, "skinny" where skinny_rows
    has N, else "onednn"."""
    rows = x.shape[0]
    if rows == 1:
        return one_row_form(x.dtype, *weight.shape)
    return "skinny" if rows in skinny_rows(x.dtype, *weight.shape) else "onednn"


def small_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
                  form: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x (N, in) @ weight.T + bias in one of product_form's forms other than oneDNN: one row as one of
    one_row_form's GEMVs ("transposed" or "rows"), one or a few rows on the few-row kernel ("skinny"); at most one
    of bias and residual."""
    if form == "skinny":
        return skinny.product(x, packed.skinny(weight), bias, residual)
    t = packed.transposed(weight) if form == "transposed" else weight.t()
    add = bias if residual is None else residual
    return torch.mm(x, t) if add is None else torch.addmm(add, x, t)


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether CPU inference in `dtype` runs its GEMMs on oneDNN's packed weights: float32, or bfloat16 where
    the CPU has bf16 units (oneDNN packs bf16 weights only there), while onednn_linear_available()."""
    return onednn_linear_available() and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_cpu_bf16()))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None, int8: bool = False) -> torch.Tensor:
    """F.linear, on oneDNN with `packed` weights for CPU inference in float32 or bfloat16 (no autograd
    involved), one row as MKL's GEMV where one_row_form says, a few on the few-row kernel where skinny_rows
    says; int8: on the packed int8 copy of the weights
    instead (a draft head where draft_int8_pays); every other case (training, GPUs, float16, mixed dtypes) is
    plain F.linear."""
    if int8 and packed is not None and x.device.type == "cpu" and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return int8_product(x, packed.int8(weight, bias), weight.shape[0])
    if (packed is None or x.device.type != "cpu" or x.dtype != weight.dtype or not onednn_serves(x.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    form = product_form(x2, weight)
    if form != "onednn":
        out = small_product(x2, weight, bias, packed, form)
    else:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed.get(weight), bias, "none", [], "")
    return out.view(*shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear whose CPU float32 inference runs on oneDNN (see `linear`); same weights, same state_dict.
    int8: its CPU inference runs on an int8 copy of its weights (set by the drafter that serves it; a copy of the
    module is a plain one again)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed = PackedWeight()
        self.int8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed, self.int8)

    def __getstate__(self) -> dict:  # deepcopy and pickle: the packed copy is an opaque cache
        state = self.__dict__.copy()
        state["_packed"], state["int8"] = PackedWeight(), False
        return state


# draft_int8_pays: a draft head's products at one row are served from int8 copies of its weights where that is
# this much faster, summed over the head's weight shapes, than its own precision's (oneDNN's packed GEMM)
DRAFT_INT8_MARGIN = 1.1
DRAFT_INT8_MODES = ("auto", "on", "off")


@functools.cache
def draft_int8_pays(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """Whether a CPU draft head of these weight shapes (out, in) in `dtype` drafts faster with its products on int8
    copies of its weights (PackedWeight.int8; the head itself keeps its weights, trains and swaps as before): timed
    once per (dtype, shapes) and process at one row over cold weights, as a tail's drafting reads them (the policy's
    evict the head's every step). On a 2-core AMD EPYC with AVX512-BF16 the shipped head's products at one row took
    0.79 ms in int8 against 1.55 in bf16, and a step at one row 40.8 ms against 42.2 at k = 2, 44.5 against 49.1 at
    k = 4 (docs/benchmarks.md, "Int8 draft products"). A head whose every weight is a small_weight is not timed: it
    keeps its precision. TLT_CPU_DRAFT_INT8=auto (the default) times it; on or off forces the answer (on still needs
    torch's int8 kernels)."""
    mode = os.environ.get("TLT_CPU_DRAFT_INT8", "auto").lower()
    if mode not in DRAFT_INT8_MODES:
        raise ValueError(f"TLT_CPU_DRAFT_INT8 must be one of {', '.join(DRAFT_INT8_MODES)}, got {mode!r}")
    if mode == "off" or not int8_linear_available():
        return False
    if mode == "on":
        return True
    if all(small_weight(*shape) for shape in shapes):  # a tiny head: int8 costs its calls (64 x 64: 103 us, 34 dense)
        return False
    times = [_dense_and_int8_seconds(dtype, out_features, in_features) for out_features, in_features in shapes]
    return sum(t[1] for t in times) * DRAFT_INT8_MARGIN < sum(t[0] for t in times)


def _dense_and_int8_seconds(dtype: torch.dtype, out_features: int, in_features: int) -> tuple[float, float]:
    """(seconds, seconds): a one-row product of this shape in `dtype` as `linear` runs it, and on int8 copies
    (fastest_seconds over cold copies of the weight)."""
    n = probe_copies(out_features, in_features, least=2)
    with torch.inference_mode():
        # a list: one tensor object per copy, as a layer holds its weight (the packed copies are keyed by it)
        weights = list(torch.full((n, out_features, in_features), 1e-3, device="cpu").to(dtype).unbind(0))
        x = torch.full((1, in_features), 1e-3, device="cpu", dtype=dtype)
        packs = [PackedWeight() for _ in range(n)]
        forms = {"dense": lambda: [linear(x, w, None, p) for w, p in zip(weights, packs)],
                 "int8": lambda: [int8_product(x, p.int8(w, None), out_features) for w, p in zip(weights, packs)]}
        for form in forms.values():  # untimed: packs and quantizes the copies
            form()
        best = fastest_seconds(forms)
    return best["dense"], best["int8"]
