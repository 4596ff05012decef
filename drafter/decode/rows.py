"""One sequence of a generate call as the engine keeps it (`Row`), and stop strings checked incrementally
(`StopWatch`): each appended token decodes a window of a few tokens and searches only the new text plus the
tail a stop string could straddle, so checking costs amortized O(1) per token instead of decoding the whole
response at every token (O(n^2) over a long response)."""

from __future__ import annotations

import random

import torch

from drafter.decode.sampling import SamplingParams
from drafter.decode.static import to_device

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to: wait for the next token


def find_stop(tokenizer, token_ids: list[int], stops: tuple[str, ...]) -> int:
    """Where the first stop string starts in the decoded token_ids, -1 if none: the reference the incremental
    check agrees with (and what the final text is cut at)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class StopWatch:
    """Incremental detokenization (the prefix/read offsets of HF's and vLLM's streaming detokenizers): the text
    of the tokens so far is extended by decoding ids[prefix:] against ids[prefix:read], a window of the last
    token or two, and only `tail` (the text a stop string ending in the new text could start in) is searched."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError(f"stop_strings must be non-empty strings, got {stops!r}")
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.keep = max(len(s) for s in stops) - 1  # chars of old text a new match can start in
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the window whose text is already in `tail`
        self.tail = ""  # the last `keep` chars of the text so far
        self.num_decoded = 0  # decode calls, for the cost test

    def _decode(self, ids: list[int]) -> str:
        self.num_decoded += 1
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, token: int) -> bool:
        """Append one token; True when the text now contains a stop string."""
        self.ids.append(token)
        old = self._decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        new = self._decode(self.ids[self.prefix :])
        if len(new) <= len(old) or new.endswith(REPLACEMENT):
            return False  # no complete character yet (a multi-byte one spans tokens)
        window = self.tail + new[len(old) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.tail = window[len(window) - self.keep :] if self.keep else ""
        return any(s in window for s in self.stops)


class Row:
    """Live state of one sequence."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_ids: tuple[int, ...], limit: int,
                 record_hidden: bool, tokenizer=None) -> None:
        self.prompt_ids, self.params, self.limit = prompt_ids, params, limit
        self.tokens = list(prompt_ids)
        self.num_prompt = len(self.tokens)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.stops = StopWatch(tokenizer, params.stop_strings) if params.stop_strings else None
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = self.drafted = self.accepted = 0
        self.finish_reason: str | None = None
        self.hidden: list[torch.Tensor] | None = [] if record_hidden else None
        self.prompt_hidden: torch.Tensor | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def text(self, tokenizer) -> str | None:
        """The generated text (None without a tokenizer), cut where a stop string starts."""
        if tokenizer is None:
            return None
        gen = self.generated
        text = tokenizer.decode(gen, skip_special_tokens=True)
        if self.params.stop_strings:
            cut = find_stop(tokenizer, gen, self.params.stop_strings)
            text = tokenizer.decode(gen, skip_special_tokens=False)[:cut] if cut >= 0 else text
        return text

    def cap(self, k: int) -> int:
        """Drafts worth proposing: never past max_new_tokens or the context, none once finished."""
        return 0 if self.finish_reason else max(0, min(k, self.limit - len(self.tokens) - 1))

    def append(self, new: list[int]) -> list[int]:
        """Append tokens one at a time, stopping exactly where plain decoding would stop."""
        taken = []
        for t in new:
            self.tokens.append(t)
            taken.append(t)
            hit = self.stops.push(t) if self.stops is not None else False
            if t in self.stop_ids or hit:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.limit:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return taken


def draw_uniforms(live: list[Row], n: int, device: torch.device) -> torch.Tensor:
    """(B, n) per row: for a chain of k, n = 2k+1: k acceptance tests, one final draw, k for sampled drafts; for a
    tree, its tests and final draw, then one per node. Drawn per row on the CPU (each row's torch.Generator lives
    there), so a row's random stream depends on its own seed only; then moved to `device` in one copy."""
    return to_device(torch.stack([torch.rand(n, generator=r.gen, device="cpu") for r in live]), device)


def distinct_prompts(rows: list[Row]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts of `rows` (their prompt[:-1], what a prefill feeds) in first-seen order, and each row's
    index among them: a GRPO group's rows share one."""
    first: dict[tuple[int, ...], int] = {}
    source = [first.setdefault(tuple(r.tokens[:-1]), len(first)) for r in rows]
    return [list(p) for p in first], source
