"""Capturing one CUDA graph, done the same way wherever the decode path captures (the policy's steps, the draft's
steps, verification): a warm-up run on a side stream, then the capture, with Python's cyclic garbage collector
paused for it.

Why the pause: torch no longer collects before a capture (torch.compiler.config.force_cudagraph_gc is off by
default), so a collection that the capture's own allocations set off can free a dead CUDAGraph (an engine, a
drafter or a graph set dropped earlier, held in a reference cycle) in the middle of it. Destroying a graph is not
permitted while a stream captures, and the capture then fails ("operation failed due to a previous error during
capture"). Seen on an H200: a test's engine, collected during the next test's draft capture, failed it."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, and as it was after (also when the block raises)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(fn: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture `fn` (reading and writing only static buffers) as a CUDA graph in memory pool `pool` (None: a new
    one, `graph.pool()` after). It runs once on a side stream first, uncaptured (cuBLAS handles, workspaces, lazy
    state), so `fn` must be idempotent on its inputs: what it writes, the capture and every replay write again.
    Returns the graph and what the captured call returned (its output tensors, rewritten by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
