"""Continuous batching on the host: requests, the page allocator, and the scheduler that packs each engine
step (examples/lm/serving.py runs the steps).

A request arrives at an engine step with a prompt and a budget of new tokens. The scheduler admits it when a
sequence slot is free and the page pool can hold all of it on top of what the running requests may still
need (so no running request ever waits for a page, and none is preempted); its pages are handed out as its
keys and values grow, a page at a time, and all taken back when it finishes. Each step packs, for every
running request, either its next prompt chunk (at most `chunk_size` tokens) or its newest token, decodes
first, into one row of at most the largest token bucket; the row is padded to the smallest bucket that holds
it, so the compiled step sees a few static shapes while the number of sequences stays a traced value.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """The engine's static shapes and policy; every field is a compile-time constant of the step."""

    page_size: int = 16  # keys per page; a power of two >= 16 (the kernels' pages)
    num_pages: int = 64  # pages in the pool, per layer, for keys (and as many for values)
    max_seqs: int = 8  # sequence slots of a step (S); a request waits for a free one
    pages_per_seq: int = 16  # page table width: a request holds at most page_size * pages_per_seq positions
    chunk_size: int = 32  # prompt tokens a request feeds per step (chunked prefill)
    token_buckets: tuple[int, ...] = (16, 64)  # packed row lengths the step is compiled for (num_tokens)
    kv_dtype: str = "compute"  # "compute": pages in the model's dtype; "int8": int8 pages with per-head scales

    def __post_init__(self):
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two >= 16.")
        for name in ("num_pages", "max_seqs", "pages_per_seq", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if not self.token_buckets or list(self.token_buckets) != sorted(set(self.token_buckets)):
            raise ValueError(f"token_buckets={self.token_buckets} must be increasing and not empty.")
        if self.max_seqs > self.max_tokens:
            # Every running request's decode token must fit one step, or a prompt could wait forever.
            raise ValueError(f"max_seqs={self.max_seqs} must be at most the largest token bucket, {self.max_tokens}.")
        if self.kv_dtype not in ("compute", "int8"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r} is not one of 'compute', 'int8'.")

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    @property
    def max_length(self) -> int:
        """The most positions (prompt and new tokens but the last) one request can hold."""
        return self.page_size * self.pages_per_seq


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt `[L]` int32 (L >= 1) and a budget of new tokens, arriving at engine step `arrival`."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    arrival: int = 0

    @property
    def length(self) -> int:
        """Positions whose keys the request writes: all but its last new token, which is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1


class Schedule(NamedTuple):
    """One engine step's inputs (the `ragged_paged_attention` layout), padded to static shapes.

    `tokens` `[T]` int32: the new tokens of the running sequences packed in order, then padding; sequence i's
    are `tokens[cu_q_lens[i]:cu_q_lens[i + 1]]`. `kv_lens` `[S]` int32: its positions after this step (new
    tokens included). `page_indices` `[S, pages_per_seq]` int32: its pages, in position order. `cu_q_lens`
    `[S + 1]` int32. `num_seqs` `[]` int32: the sequences from num_seqs on are padding (length 0, no tokens).
    """

    tokens: np.ndarray
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray


class PageAllocator:
    """A free list of page ids 0..num_pages-1. `allocate` hands out a page no one holds and `free` takes back
    pages it handed out; anything else is a ValueError (a page freed twice, or one never handed out)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ValueError(f"no free page: all {self.num_pages} are held.")
        page = self._free.popleft()
        self._held.add(page)
        return page

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._held:
                raise ValueError(f"page {page} is not held: freed twice or never allocated.")
            self._held.remove(page)
            self._free.append(page)


@dataclasses.dataclass
class _Sequence:
    request: Request
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the pages
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt)

    def inputs(self, count: int) -> np.ndarray:
        """The next `count` tokens to feed: prompt tokens, or the newest generated one."""
        if self.prefilling:
            return self.request.prompt[self.computed : self.computed + count]
        return np.asarray(self.generated[-1:], np.int32)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step runs: its `schedule`, and the sequences in it with their token counts, in packed order."""

    schedule: Schedule
    sequences: tuple[_Sequence, ...]
    counts: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


class Scheduler:
    """Admits requests, packs steps (`plan`), and records their sampled tokens (`commit`)."""

    def __init__(self, serving: ServingConfig, allocator: PageAllocator | None = None):
        self.serving = serving
        self.allocator = PageAllocator(serving.num_pages) if allocator is None else allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[_Sequence] = []

    def add(self, request: Request) -> None:
        """Queue `request` (requests are admitted in the order they are added)."""
        serving, length = self.serving, len(request.prompt)
        if length < 1 or request.max_new_tokens < 1:
            raise ValueError(f"request {request.id}: prompt length {length} and max_new_tokens "
                             f"{request.max_new_tokens} must both be at least 1.")
        if request.length > serving.max_length or self._pages(request.length) > serving.num_pages:
            raise ValueError(f"request {request.id}: {request.length} positions need {self._pages(request.length)} "
                             f"pages; a request holds at most {serving.pages_per_seq} pages of {serving.page_size} "
                             f"and the pool has {serving.num_pages}.")
        self.waiting.append(request)

    def _pages(self, positions: int) -> int:
        return -(-positions // self.serving.page_size)

    def _admit(self, step: int) -> None:
        """Requests that have arrived by `step`, in order, while a slot is free and the pool can hold each on
        top of the pages the running requests may still take."""
        promised = sum(self._pages(s.request.length) - len(s.pages) for s in self.running)
        while self.waiting and self.waiting[0].arrival <= step and len(self.running) < self.serving.max_seqs:
            need = self._pages(self.waiting[0].length)
            if self.allocator.num_free - promised < need:
                break
            promised += need
            self.running.append(_Sequence(self.waiting.popleft()))

    def plan(self, step: int) -> StepPlan | None:
        """The packed step `step` runs, or None when no request is running (nothing has arrived)."""
        self._admit(step)
        serving, budget = self.serving, self.serving.max_tokens
        decoding = [s for s in self.running if not s.prefilling]
        prefilling = [s for s in self.running if s.prefilling]
        sequences, counts = [], []
        for sequence in decoding + prefilling:
            remaining = len(sequence.request.prompt) - sequence.computed
            count = min(serving.chunk_size, remaining, budget) if sequence.prefilling else 1
            if count == 0:
                break
            while len(sequence.pages) < self._pages(sequence.computed + count):
                sequence.pages.append(self.allocator.allocate())
            sequences.append(sequence)
            counts.append(count)
            budget -= count
        if not sequences:
            return None
        return StepPlan(self._schedule(sequences, counts), tuple(sequences), tuple(counts))

    def _schedule(self, sequences: list[_Sequence], counts: list[int]) -> Schedule:
        serving, used = self.serving, sum(counts)
        num_tokens = serving.token_buckets[bisect.bisect_left(serving.token_buckets, used)]
        tokens = np.zeros(num_tokens, np.int32)
        kv_lens = np.zeros(serving.max_seqs, np.int32)
        page_indices = np.zeros((serving.max_seqs, serving.pages_per_seq), np.int32)
        cu_q_lens = np.full(serving.max_seqs + 1, used, np.int32)
        cu_q_lens[: len(counts) + 1] = np.cumsum([0, *counts])
        for i, (sequence, count) in enumerate(zip(sequences, counts)):
            tokens[cu_q_lens[i] : cu_q_lens[i + 1]] = sequence.inputs(count)
            kv_lens[i] = sequence.computed + count
            page_indices[i, : len(sequence.pages)] = sequence.pages
        return Schedule(tokens, kv_lens, page_indices, cu_q_lens, np.asarray(len(counts), np.int32))

    def commit(self, plan: StepPlan, next_tokens: np.ndarray) -> list[tuple[Request, np.ndarray]]:
        """Records the step: each sequence's keys grew by its count, and `next_tokens` `[S]` (the greedy
        token after each sequence's last packed one) is its next token unless its prompt is not done. Returns
        the requests that finished, with their new tokens `[max_new_tokens]` int32; their pages are free."""
        finished = []
        for i, (sequence, count) in enumerate(zip(plan.sequences, plan.counts)):
            sequence.computed += count
            if not sequence.prefilling:
                sequence.generated.append(int(next_tokens[i]))
            if len(sequence.generated) == sequence.request.max_new_tokens:
                self.allocator.free(sequence.pages)
                self.running.remove(sequence)
                finished.append((sequence.request, np.asarray(sequence.generated, np.int32)))
        return finished
