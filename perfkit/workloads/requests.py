"""Seeded synthetic requests: token ids, token types, output lengths and multimodal items.

A request is everything the runner hands the engine: prompt token ids (int32), their types (0 text, 1 image,
2 video; boi/eoi and video timestamps are text, as in HF's `mm_token_type_ids`), the number of tokens to
generate, and one `MMItem` per image or video. Pixels are not stored: the runtime makes them from the item's
seed, so requests stay small and byte-identical across runs.

Prompt layout (the order of a request's tokens):

    [shared prefix: shared_prefix_len text tokens, identical across requests]
    [lead-in text] image0 [gap text] image1 ... [gap text] video [tail text]

    image = boi + K x image_token + eoi                           (K = images.tokens_per_image)
    video = frame0 sep frame1 sep ...                             (sep = one text token)
    frame = T timestamp text tokens ("mm:ss ") + boi + n x video_token + eoi     (T = VIDEO_TIMESTAMP_TOKENS)

The ISL drawn from `workload.isl` is the number of text tokens after the shared prefix (lead-in + gaps + tail);
the lead-in takes up to LEAD_IN_TOKENS of them, each following item up to GAP_TOKENS, the tail the rest. boi,
eoi, timestamps and frame separators come on top, so a prompt is exactly
`shared_prefix_len + isl + images.count*(K+2) + frames*(n+2+T) + frames-1` tokens long, within the bound
`config.RunConfig` checks (`frames*(n+6)`). The first prompt token is bos (it counts as one of the prefix
tokens, or of the ISL when there is no prefix), except for dataset lines given as `input_ids`, used verbatim.

Determinism: request i depends only on (workload, seed, token space, i), never on n, so
`generate_requests(w, 10, ...)[:5] == generate_requests(w, 5, ...)` and `iter_requests` streams the same requests
for duration-limited scenarios.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from perfkit.config import LengthDist, WorkloadConfig, stable_hash
from perfkit.errors import PerfkitError

GENERATOR_VERSION = 1  # bump when the same config + seed would produce different requests

TEXT, IMAGE, VIDEO = 0, 1, 2  # token_type_ids values

LEAD_IN_TOKENS = 4  # text before the first multimodal item (taken from the ISL)
GAP_TOKENS = 2  # text between consecutive multimodal items (taken from the ISL)
VIDEO_TIMESTAMP_TOKENS = 3  # "mm:ss " before each video frame (on top of the ISL)

_SEED_SPACE = 1 << 63  # MMItem seeds live in [0, 2**63)

# sub-streams of the workload's seed sequence
_STREAM_PREFIX, _STREAM_MM_BASE, _STREAM_REQUEST = 1, 2, 3


# --------------------------------------------------------------------------------------------------------------
# Token space
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenSpace:
    """The ids a generator may use, taken from the model config (see `from_model_config`).

    Text tokens are drawn uniformly from [0, vocab_size) minus every special id (bos, the multimodal ids and
    `reserved_ids`: pad, eos, audio, chat tokens...).
    """

    vocab_size: int
    image_token_id: int
    video_token_id: int
    boi_token_id: int
    eoi_token_id: int
    bos_token_id: int | None = None
    reserved_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise PerfkitError(f"token space: vocab_size must be >= 1 (got {self.vocab_size})")
        for name, tid in self._named_ids():
            if not 0 <= tid < self.vocab_size:
                raise PerfkitError(f"token space: {name} {tid} is outside the vocab [0, {self.vocab_size})")
        if self.num_text_ids < 1:
            raise PerfkitError(f"token space: no text ids left in a vocab of {self.vocab_size} after special ids")

    def _named_ids(self) -> list[tuple[str, int]]:
        ids = [
            ("image_token_id", self.image_token_id),
            ("video_token_id", self.video_token_id),
            ("boi_token_id", self.boi_token_id),
            ("eoi_token_id", self.eoi_token_id),
        ]
        if self.bos_token_id is not None:
            ids.append(("bos_token_id", self.bos_token_id))
        ids += [("reserved id", t) for t in self.reserved_ids]
        return ids

    @property
    def excluded_ids(self) -> np.ndarray:
        """Sorted unique ids never drawn as text."""
        return np.unique(np.array([t for _, t in self._named_ids()], dtype=np.int64))

    @property
    def num_text_ids(self) -> int:
        return self.vocab_size - len(self.excluded_ids)

    def text_ids(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` text ids drawn uniformly from the allowed ids (int32)."""
        k = rng.integers(0, self.num_text_ids, size=n, dtype=np.int64)
        ex = self.excluded_ids
        # k-th allowed id = k + number of excluded ids at or below it; ex - arange is non-decreasing
        shift = np.searchsorted(ex - np.arange(len(ex)), k, side="right")
        return (k + shift).astype(np.int32)

    @classmethod
    def from_model_config(cls, cfg: Any) -> TokenSpace:
        """From any object with Gemma4Config's token attributes (duck-typed: no runtime import)."""
        reserved: list[int] = []
        for name in ("pad_token_id", "eos_token_id", "audio_token_id", "boa_token_id", "eoa_token_id"):
            value = getattr(cfg, name, None)
            if value is None:
                continue
            reserved += [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
        special = getattr(cfg, "special_token_ids", None)
        if callable(special):
            reserved += [int(v) for v in special()]
        bos = getattr(cfg, "bos_token_id", None)
        return cls(
            vocab_size=int(cfg.vocab_size),
            image_token_id=int(cfg.image_token_id),
            video_token_id=int(cfg.video_token_id),
            boi_token_id=int(cfg.boi_token_id),
            eoi_token_id=int(cfg.eoi_token_id),
            bos_token_id=None if bos is None else int(bos),
            reserved_ids=tuple(sorted(set(reserved))),
        )

    @classmethod
    def gemma4(cls) -> TokenSpace:
        """The released Gemma4 checkpoints' ids (reference/gemma4.md §1, §4.3)."""
        return cls(
            vocab_size=262144,
            image_token_id=258880,
            video_token_id=258884,
            boi_token_id=255999,
            eoi_token_id=258882,
            bos_token_id=2,
            reserved_ids=(0, 1, 106, 256000, 258881, 258883),
        )

    def identity(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "image": self.image_token_id,
            "video": self.video_token_id,
            "boi": self.boi_token_id,
            "eoi": self.eoi_token_id,
            "bos": self.bos_token_id,
            "reserved": list(self.reserved_ids),
        }


# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MMItem:
    """One image or one video. The runtime generates its pixels from `seed` (distinct per item).

    num_soft_tokens: soft tokens per image, or per frame for a video (total = num_frames * num_soft_tokens).
    offsets: prompt position of the first soft token of each run (one per image / per frame), so the scheduler
    can align chunks to blobs without scanning token types.
    """

    kind: Literal["image", "video"]
    num_soft_tokens: int
    seed: int
    num_frames: int = 1
    offsets: tuple[int, ...] = ()

    @property
    def total_soft_tokens(self) -> int:
        return self.num_frames * self.num_soft_tokens


@dataclass(frozen=True, eq=False)
class Request:
    """One synthetic request. Arrays are read-only; compare requests with `digest()`."""

    request_id: int
    prompt_token_ids: np.ndarray  # int32 [L]
    token_type_ids: np.ndarray  # int8 [L]: 0 text (incl. boi/eoi/timestamps), 1 image, 2 video
    output_len: int
    mm_items: tuple[MMItem, ...] = ()
    shared_prefix_len: int = 0  # leading tokens identical across the workload's requests
    num_text_tokens: int = field(init=False)
    num_image_tokens: int = field(init=False)
    num_video_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.prompt_token_ids, dtype=np.int32)
        types = np.ascontiguousarray(self.token_type_ids, dtype=np.int8)
        if ids.ndim != 1 or ids.shape != types.shape:
            raise ValueError(f"prompt_token_ids {ids.shape} and token_type_ids {types.shape} must be equal 1-D")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1 (got {self.output_len})")
        ids.setflags(write=False)
        types.setflags(write=False)
        counts = np.bincount(types, minlength=3)
        object.__setattr__(self, "prompt_token_ids", ids)
        object.__setattr__(self, "token_type_ids", types)
        object.__setattr__(self, "num_text_tokens", int(counts[TEXT]))
        object.__setattr__(self, "num_image_tokens", int(counts[IMAGE]))
        object.__setattr__(self, "num_video_tokens", int(counts[VIDEO]))

    @property
    def input_len(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def num_vision_tokens(self) -> int:
        return self.num_image_tokens + self.num_video_tokens

    def digest(self) -> str:
        """sha256 over every field, byte-exact."""
        h = hashlib.sha256()
        _update(h, self)
        return h.hexdigest()


def _update(h: Any, r: Request) -> None:
    head = [r.request_id, r.output_len, r.shared_prefix_len, r.input_len]
    head += [[m.kind, m.num_soft_tokens, m.seed, m.num_frames, list(m.offsets)] for m in r.mm_items]
    h.update(json.dumps(head, separators=(",", ":")).encode())
    h.update(r.prompt_token_ids.tobytes())
    h.update(r.token_type_ids.tobytes())


def requests_digest(requests: Iterable[Request]) -> str:
    """sha256 of a request list: equal digests = byte-identical requests."""
    h = hashlib.sha256()
    for r in requests:
        _update(h, r)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Lengths
# --------------------------------------------------------------------------------------------------------------


def sample_lengths(dist: LengthDist, rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` integer lengths from `dist`, rounded, clipped to [min, max] and >= 1 (int64).

    uniform: integers in [round(mean*(1-r)), round(mean*(1+r))]; normal: N(mean, std); lognormal: exp(N(ln mean,
    sigma)) so the median is `mean`.
    """
    if dist.dist == "fixed":
        x = np.full(size, float(dist.mean))
    elif dist.dist == "uniform":
        lo = max(1, int(math.floor(dist.mean * (1 - dist.range_ratio) + 0.5)))
        hi = max(lo, int(math.floor(dist.mean * (1 + dist.range_ratio) + 0.5)))
        x = rng.integers(lo, hi + 1, size=size).astype(np.float64)
    elif dist.dist == "normal":
        x = rng.normal(float(dist.mean), dist.std, size=size)
    elif dist.dist == "lognormal":
        x = rng.lognormal(math.log(dist.mean), dist.sigma, size=size)
    else:  # pragma: no cover - config restricts the literal
        raise PerfkitError(f"unknown length distribution {dist.dist!r}")
    hi_clip = float(dist.max) if dist.max is not None else np.inf
    x = np.clip(np.floor(x + 0.5), max(1, dist.min), hi_clip)
    return x.astype(np.int64)


# --------------------------------------------------------------------------------------------------------------
# Datasets (trtllm-bench style JSONL)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetEntry:
    input_ids: np.ndarray | None  # int32, verbatim prompt text
    input_len: int | None  # synthetic text of this length when input_ids is absent
    output_len: int | None  # None: drawn from workload.osl


_DATASET_KEYS = ("input_ids", "input_len", "output_len", "output_tokens", "task_id")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_dataset(path: str | Path, token_space: TokenSpace | None = None) -> list[DatasetEntry]:
    """Read a JSONL dataset: one `{"input_ids": [...] | "input_len": N, "output_len": M}` object a line.

    `output_tokens` (trtllm-bench's name) is accepted for `output_len` and `task_id` is ignored; blank lines are
    skipped. Any other problem is a PerfkitError naming the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise PerfkitError(f"dataset file not found: {p}")
    entries: list[DatasetEntry] = []
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            entries.append(_parse_line(line, f"{p}:{lineno}", token_space))
    if not entries:
        raise PerfkitError(f"{p}: dataset has no requests")
    return entries


def _parse_line(line: str, where: str, token_space: TokenSpace | None) -> DatasetEntry:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise PerfkitError(f"{where}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise PerfkitError(f'{where}: expected a JSON object like {{"input_len": 128, "output_len": 64}}')
    unknown = sorted(set(obj) - set(_DATASET_KEYS))
    if unknown:
        hint = " (text prompts need a tokenizer; give input_ids)" if "prompt" in unknown else ""
        raise PerfkitError(f"{where}: unknown key(s) {', '.join(unknown)}{hint}; allowed: {', '.join(_DATASET_KEYS)}")
    if ("input_ids" in obj) == ("input_len" in obj):
        raise PerfkitError(f"{where}: give exactly one of input_ids or input_len")
    if "output_len" in obj and "output_tokens" in obj:
        raise PerfkitError(f"{where}: give output_len or output_tokens, not both")
    out = obj.get("output_len", obj.get("output_tokens"))
    if out is not None and (not _is_int(out) or out < 1):
        raise PerfkitError(f"{where}: output_len must be an integer >= 1 (got {out!r})")
    if "input_len" in obj:
        n = obj["input_len"]
        if not _is_int(n) or n < 1:
            raise PerfkitError(f"{where}: input_len must be an integer >= 1 (got {n!r})")
        return DatasetEntry(None, n, out)
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise PerfkitError(f"{where}: input_ids must be a non-empty list of integers")
    arr = np.asarray(ids, dtype=np.int64)
    vocab = token_space.vocab_size if token_space is not None else 1 << 31
    if arr.min() < 0 or arr.max() >= vocab:
        bad = int(arr[(arr < 0) | (arr >= vocab)][0])
        raise PerfkitError(f"{where}: input_ids contains {bad}, outside the vocab [0, {vocab})")
    return DatasetEntry(arr.astype(np.int32), None, out)


def _dataset_path(workload: WorkloadConfig, base_dir: str | Path | None) -> Path:
    assert workload.dataset is not None
    p = Path(workload.dataset).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return p


# --------------------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------------------


def _entropy(workload: WorkloadConfig, seed: int) -> list[int]:
    return [GENERATOR_VERSION, int(workload.seed) % (1 << 64), int(seed) % (1 << 64)]


def _rng(entropy: list[int], *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=key))


class _Generator:
    """Builds request i on demand; holds what is shared across requests (prefix, dataset, seed base)."""

    def __init__(
        self, workload: WorkloadConfig, token_space: TokenSpace, seed: int, base_dir: str | Path | None
    ) -> None:
        if workload.isl is not None and workload.dataset is not None:
            raise PerfkitError("workload: set isl or dataset, not both (the dataset gives each request's input)")
        self.w = workload
        self.ts = token_space
        self.entropy = _entropy(workload, seed)
        self.dataset = load_dataset(_dataset_path(workload, base_dir), token_space) if workload.dataset else None
        self.prefix = token_space.text_ids(_rng(self.entropy, _STREAM_PREFIX), workload.shared_prefix_len)
        if len(self.prefix) and token_space.bos_token_id is not None:
            self.prefix[0] = token_space.bos_token_id
        self.items_per_request = int(workload.images.count if workload.images else 0) + int(workload.video is not None)
        self.mm_seed_base = int(_rng(self.entropy, _STREAM_MM_BASE).integers(0, _SEED_SPACE))

    def request(self, i: int) -> Request:
        rng = _rng(self.entropy, _STREAM_REQUEST, i)
        w, ts = self.w, self.ts
        # draw order is fixed: output length, input length, text, multimodal text
        osl = int(sample_lengths(w.osl, rng, 1)[0])
        verbatim = False
        if self.dataset is not None:
            entry = self.dataset[i % len(self.dataset)]
            if entry.output_len is not None:
                osl = entry.output_len
            if entry.input_ids is not None:
                text, verbatim = entry.input_ids, True
            else:
                text = ts.text_ids(rng, int(entry.input_len or 1))
        else:
            assert w.isl is not None
            text = ts.text_ids(rng, int(sample_lengths(w.isl, rng, 1)[0]))
        if not verbatim and len(self.prefix) == 0 and len(text) and ts.bos_token_id is not None:
            text[0] = ts.bos_token_id

        ids: list[np.ndarray] = [self.prefix]
        types: list[np.ndarray] = [np.zeros(len(self.prefix), np.int8)]
        pos = len(self.prefix)

        def put(chunk: np.ndarray, kind: int) -> int:
            nonlocal pos
            start = pos
            ids.append(np.asarray(chunk, dtype=np.int32))
            types.append(np.full(len(chunk), kind, np.int8))
            pos += len(chunk)
            return start

        def const(tid: int, n: int) -> np.ndarray:
            return np.full(n, tid, np.int32)

        items: list[MMItem] = []
        cut = 0  # text tokens of this request used so far
        item_seed = self.mm_seed_base + i * self.items_per_request

        def lead(n_max: int) -> None:
            nonlocal cut
            take = min(n_max, len(text) - cut)
            put(text[cut : cut + take], TEXT)
            cut += take

        if w.images is not None:
            k = w.images.tokens_per_image
            for j in range(w.images.count):
                lead(LEAD_IN_TOKENS if j == 0 else GAP_TOKENS)
                put(const(ts.boi_token_id, 1), TEXT)
                start = put(const(ts.image_token_id, k), IMAGE)
                put(const(ts.eoi_token_id, 1), TEXT)
                seed = (item_seed + len(items)) % _SEED_SPACE
                items.append(MMItem("image", k, seed, 1, (start,)))
        if w.video is not None:
            lead(LEAD_IN_TOKENS if not items else GAP_TOKENS)
            n = w.video.tokens_per_frame
            mm_text = ts.text_ids(rng, w.video.frames * (VIDEO_TIMESTAMP_TOKENS + 1))
            offsets = []
            for f in range(w.video.frames):
                stamp = mm_text[f * (VIDEO_TIMESTAMP_TOKENS + 1) : (f + 1) * (VIDEO_TIMESTAMP_TOKENS + 1)]
                if f:
                    put(stamp[-1:], TEXT)  # frame separator
                put(stamp[:-1], TEXT)
                put(const(ts.boi_token_id, 1), TEXT)
                offsets.append(put(const(ts.video_token_id, n), VIDEO))
                put(const(ts.eoi_token_id, 1), TEXT)
            seed = (item_seed + len(items)) % _SEED_SPACE
            items.append(MMItem("video", n, seed, w.video.frames, tuple(offsets)))
        put(text[cut:], TEXT)

        return Request(
            request_id=i,
            prompt_token_ids=np.concatenate(ids),
            token_type_ids=np.concatenate(types),
            output_len=osl,
            mm_items=tuple(items),
            shared_prefix_len=len(self.prefix),
        )


def generate_requests(
    workload: WorkloadConfig,
    n: int,
    token_space: TokenSpace,
    seed: int = 0,
    *,
    base_dir: str | Path | None = None,
) -> list[Request]:
    """`n` requests of `workload`. Byte-identical for the same (workload, n, token_space, seed, dataset bytes).

    `seed` is the run-level seed, mixed with `workload.seed`; pass the same value to every arm of an A/B so
    both arms see the same requests. A relative `workload.dataset` is resolved against `base_dir` (the config
    file's directory) when given, else the working directory.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0 (got {n})")
    gen = _Generator(workload, token_space, seed, base_dir)
    return [gen.request(i) for i in range(n)]


def iter_requests(
    workload: WorkloadConfig,
    token_space: TokenSpace,
    seed: int = 0,
    *,
    start: int = 0,
    base_dir: str | Path | None = None,
) -> Iterator[Request]:
    """Endless stream of the same requests `generate_requests` makes (for duration-limited scenarios)."""
    gen = _Generator(workload, token_space, seed, base_dir)
    for i in itertools.count(start):
        yield gen.request(i)


def workload_hash(
    workload: WorkloadConfig,
    n: int | None,
    seed: int = 0,
    *,
    token_space: TokenSpace | None = None,
    base_dir: str | Path | None = None,
) -> str:
    """Short identity of the requests a (workload, n, seed) generates: the config, the generator version and,
    for a dataset, the file's sha256 (so an edited file changes the hash). Add `token_space` to pin the vocab."""
    ident: dict[str, Any] = {
        "generator": GENERATOR_VERSION,
        "workload": workload.model_dump(mode="json"),
        "n": n,
        "seed": seed,
    }
    if workload.dataset is not None:
        p = _dataset_path(workload, base_dir)
        ident["dataset_sha256"] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
    if token_space is not None:
        ident["token_space"] = token_space.identity()
    return stable_hash(ident)


def summarize(requests: Iterable[Request]) -> dict[str, Any]:
    """Token counts of a request list (intent only; measured counts come from the engine)."""
    rs = list(requests)
    return {
        "num_requests": len(rs),
        "input_tokens": sum(r.input_len for r in rs),
        "text_tokens": sum(r.num_text_tokens for r in rs),
        "image_tokens": sum(r.num_image_tokens for r in rs),
        "video_tokens": sum(r.num_video_tokens for r in rs),
        "output_tokens": sum(r.output_len for r in rs),
        "mm_items": sum(len(r.mm_items) for r in rs),
    }
