"""Continuous-batching scheduler (pure Python): FCFS, mixed decode + chunked-prefill steps, recompute preemption.

After a step is launched, `advance` applies everything that needs no token values (KV computed, a PLACEHOLDER
token appended per sampling chunk, requests at max_new_tokens finished and their pages freed), so the next step
can be scheduled while the GPU still computes the sampled ids; `commit` writes the ids in once they reach the
host (and finishes requests on EOS). `postprocess` = both at once, the synchronous step.

One `schedule()` call builds one step under two limits: at most `max_batch_size` running requests and at most
`max_num_tokens` new tokens. Order inside a step: decodes first (one token each), then prefill chunks of
running requests, then newly admitted waiting requests.

Chunk boundaries never split a vision blob (a maximal run of image/video tokens of one type, gemma4.md §4.4):
a chunk that would end inside a blob is cut back to the blob start. If that leaves nothing (the chunk starts at
a blob that does not fit the remaining budget) the request waits; if the step is otherwise empty the whole blob
is scheduled even when it exceeds `max_num_tokens` (a blob is atomic: it is the only way to make progress).
While a running request waits on a blob no new request is admitted, so the step eventually empties.

Preemption by recompute: when a running request needs pages and none are free, the most recently admitted
running request is preempted: its pages are freed, its generated tokens stay appended to its token list (the
"prompt" of the recompute), and it goes to the front of the waiting queue with num_computed = 0. Greedy output
is unchanged because the recompute re-prefills exactly the tokens it had.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from perfkit.runtime.block_manager import BlockManager

VISION_TYPES = (1, 2)  # image, video (audio = 3 is never bidirectional and never a blob)
PLACEHOLDER = -1  # a sampled token whose id is still on the device (between `advance` and `commit`)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None


@dataclass(eq=False)
class Request:
    request_id: int
    token_ids: list[int]  # prompt, then generated tokens appended
    token_type_ids: list[int]  # 0 text, 1 image, 2 video, 3 audio; generated tokens are 0
    max_new_tokens: int
    ignore_eos: bool = True
    eos_token_ids: tuple[int, ...] = ()
    mm_items: list | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_ns: int = field(default_factory=time.perf_counter_ns)
    prompt_len: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_preemptions: int = 0
    first_scheduled_ns: int | None = None
    pending_row: int | None = None  # row of its last token in the sampled ids of a step not yet committed
    blob_start: np.ndarray = field(default=None, repr=False)  # per prompt token: start of its blob or -1
    blob_end: np.ndarray = field(default=None, repr=False)  # per prompt token: end (excl.) of its blob or -1

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)
        if len(self.token_type_ids) != self.prompt_len:
            raise ValueError("token_type_ids must have one entry per prompt token")
        self.blob_start, self.blob_end = blob_bounds(self.token_type_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def splits_blob(self, end: int) -> bool:
        """Would a chunk ending at `end` (exclusive) cut a blob in two?"""
        if end <= 0 or end >= self.prompt_len:
            return False
        return self.blob_start[end] >= 0 and self.blob_start[end] == self.blob_start[end - 1]


def blob_bounds(token_type_ids) -> tuple[np.ndarray, np.ndarray]:
    """Blob [start, end) per token (-1 for non-vision). A blob is a maximal run of one vision type."""
    t = np.asarray(token_type_ids, dtype=np.int64)
    n = len(t)
    start = np.full(n, -1, dtype=np.int64)
    end = np.full(n, -1, dtype=np.int64)
    i = 0
    while i < n:
        if t[i] in VISION_TYPES:
            j = i
            while j < n and t[j] == t[i]:
                j += 1
            start[i:j] = i
            end[i:j] = j
            i = j
        else:
            i += 1
    return start, end


@dataclass(frozen=True)
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    t_host_ns: int  # perf_counter_ns right after the sampled ids reached the host
    finished: bool
    first_scheduled_ns: int | None = None  # when the request was first scheduled (queue time = this - submit)


@dataclass(frozen=True)
class SampledSlot:
    """Where a sampled token goes once its id is on the host: req.token_ids[token_index], output_ids[output_index]."""

    req: Request
    token_index: int
    output_index: int


@dataclass(frozen=True)
class ScheduledChunk:
    req: Request
    start: int  # first position of the chunk (= num_computed when scheduled)
    num_tokens: int
    is_decode: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the request's tokens (so a token is sampled from its last row)?"""
        return self.end == self.req.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    num_decodes: int
    preempted: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int):
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_tokens
        scheduled: dict[int, ScheduledChunk] = {}  # insertion order: decodes, then prefills
        preempted: list[int] = []

        def take(req: Request, n: int, is_decode: bool) -> bool:
            """Allocate pages for n more tokens (preempting from the tail if needed) and schedule the chunk."""
            nonlocal budget
            while not self.bm.can_allocate(req.request_id, req.num_computed + n):
                victim = self.running[-1]
                chunk = scheduled.pop(victim.request_id, None)
                if chunk is not None:
                    budget += chunk.num_tokens
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return False
            self.bm.allocate(req.request_id, req.num_computed + n)
            scheduled[req.request_id] = ScheduledChunk(req, req.num_computed, n, is_decode)
            budget -= n
            if req.first_scheduled_ns is None:
                req.first_scheduled_ns = time.perf_counter_ns()
            return True

        # 1. decodes
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is Status.RUNNING and req.remaining == 1:
                take(req, 1, True)
        # 2. prefill chunks of running requests
        blocked = False
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING or req.remaining <= 1 or req.request_id in scheduled:
                continue
            n = self._chunk_len(req, budget, alone=not scheduled)
            if n == 0:
                blocked = True
                continue
            take(req, n, False)
        # 3. admit waiting requests (FCFS; no preemption for admission; none right after a preemption)
        while self.waiting and not blocked and not preempted and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            n = self._chunk_len(req, budget, alone=not scheduled)
            if n == 0 or not self.bm.can_allocate(req.request_id, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            take(req, n, False)

        chunks = [c for c in scheduled.values() if c.is_decode] + [c for c in scheduled.values() if not c.is_decode]
        return SchedulerOutput(chunks, sum(c.is_decode for c in chunks), preempted)

    def _chunk_len(self, req: Request, budget: int, alone: bool) -> int:
        n = min(req.remaining, budget)
        end = req.num_computed + n
        if n < req.remaining and req.splits_blob(end):
            n = int(req.blob_start[end]) - req.num_computed
            if n <= 0:  # the chunk starts at a blob that does not fit
                n = int(req.blob_end[end]) - req.num_computed if alone else 0
        return max(n, 0)

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after a step ----------------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[SampledSlot]:
        """A launched step's effects that need no token values. Each sampling chunk appends PLACEHOLDER (its row in
        the step's sampled ids goes to `pending_row`); a request reaching max_new_tokens finishes now. Returns the
        slots to `commit`, in chunk order (= the order of the sampled ids)."""
        slots: list[SampledSlot] = []
        for c in out.chunks:
            req = c.req
            req.num_computed += c.num_tokens
            if not c.samples:
                self.bm.trim(req.request_id, req.num_computed)
                continue
            req.pending_row = len(slots)
            slots.append(SampledSlot(req, len(req.token_ids), len(req.output_ids)))
            req.token_ids.append(PLACEHOLDER)
            req.token_type_ids.append(0)
            req.output_ids.append(PLACEHOLDER)
            if len(req.output_ids) >= req.max_new_tokens:
                self._finish(req)
            else:
                self.bm.trim(req.request_id, req.num_computed)
        return slots

    def commit(self, slots: list[SampledSlot], sampled: list[int], t_host_ns: int) -> list[StepOutput]:
        """Write the sampled ids (one per slot) over their placeholders. EOS stops a request here: callers commit
        a step whose requests may stop on EOS before scheduling the next one (the engine's synchronous path)."""
        results: list[StepOutput] = []
        for slot, tok in zip(slots, sampled, strict=True):
            req, tok = slot.req, int(tok)
            req.token_ids[slot.token_index] = tok
            req.output_ids[slot.output_index] = tok
            req.pending_row = None
            if req.status is Status.RUNNING and not req.ignore_eos and tok in req.eos_token_ids:
                self._finish(req)
            finished = req.status is Status.FINISHED
            results.append(StepOutput(req.request_id, [tok], t_host_ns, finished, req.first_scheduled_ns))
        return results

    def postprocess(self, out: SchedulerOutput, sampled: list[int], t_host_ns: int) -> list[StepOutput]:
        """Advance every scheduled request; `sampled` holds one id per chunk with `samples`, in chunk order."""
        return self.commit(self.advance(out), sampled, t_host_ns)

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.bm.free(req.request_id)
        self.running.remove(req)
