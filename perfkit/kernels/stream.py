"""Load-only streaming probe: the DRAM read time a memory-bound kernel of a given size can actually reach.

A decode GEMV's "% of bound" divides by the HBM rate (4.3 TB/s here), which no kernel of a few tens of MB attains:
the launch, the ramp to full occupancy and the tail cost a few µs that a 15 µs transfer cannot amortise. Measured
with this probe on the H200 (``docs/h200-runs/2026-12-01d/7-stream_sizes.jsonl``): 16 MB read at 1.46 TB/s,
58 MB (the words of a 5376 x 21504 NVFP4 weight) at 2.43 TB/s, 131 MB at 3.04, 524 MB at 4.09; cuBLAS's bf16
GEMV over 58 MB reached 2.31 TB/s in the same session. So the kernel benchmarks report both: % of the spec
bound, and % of this measured ceiling (``stream_ms`` of the same bytes, CUDA-graph replay, L2 flushed between
replays as for the kernel itself). Since 12-13 they also report both times in a back-to-back chain over distinct
buffers (``stream_chain_us``, ``chain_columns``): the decode step's condition, where a launch does not pay the
fixed cost a lone launch does (that cost, in kernel and ceiling alike, lifts the one-launch ratio by 9-13 points
for the W4A16 gemv).

The kernel reads int32 words in contiguous per-program spans (16 B vector loads per thread, ``UNROLL`` loads in
flight per thread) and folds them with XOR into one word per lane, so nothing but the read is timed (the
store is a few KB). ``stream_ref`` computes the same fold in torch, which is what the CPU test compares.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from perfkit.kernels.launch import sm_count
from perfkit.kernels.pdl import pdl_enter, pdl_launch
from perfkit.kernels.timing import graph_ms, graph_sequence_us


@triton.jit
def _stream_kernel(
    src_ptr,  # int32 [n_words]
    out_ptr,  # int32 [programs, BLOCK]: the XOR of each lane's words
    n_words,
    words_per_program,  # multiple of BLOCK * UNROLL
    BLOCK: tl.constexpr,  # words per load step of the program (num_warps * 32 threads * 4 words)
    UNROLL: tl.constexpr,  # independent loads per thread per iteration: 1, 2 or 4
    PDL: tl.constexpr = 0,  # launched with launch_pdl (perfkit/kernels/pdl.py): every read after the wait
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    start = pid.to(tl.int64) * words_per_program
    end = tl.minimum(start + words_per_program, n_words)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for w0 in range(start, end, BLOCK * UNROLL):
        a = tl.load(src_ptr + w0 + offs, mask=w0 + offs < end, other=0)
        if UNROLL >= 2:
            b = tl.load(src_ptr + w0 + BLOCK + offs, mask=w0 + BLOCK + offs < end, other=0)
            a ^= b
        if UNROLL == 4:
            c = tl.load(src_ptr + w0 + 2 * BLOCK + offs, mask=w0 + 2 * BLOCK + offs < end, other=0)
            d = tl.load(src_ptr + w0 + 3 * BLOCK + offs, mask=w0 + 3 * BLOCK + offs < end, other=0)
            a ^= c ^ d
        acc ^= a
    tl.store(out_ptr + pid * BLOCK + offs, acc)


@dataclass(frozen=True)
class StreamConfig:
    """One launch shape of the probe: ``num_warps`` per program, ``unroll`` loads in flight per thread,
    ``programs_per_sm`` (the grid is this many programs per SM, each a contiguous span)."""

    num_warps: int = 4
    unroll: int = 2
    programs_per_sm: int = 8

    @property
    def block(self) -> int:
        return self.num_warps * 32 * 4


# Tried by ``stream_read_ms``; the ceiling is the fastest of them.
STREAM_CONFIGS: tuple[StreamConfig, ...] = (
    StreamConfig(4, 2, 8),
    StreamConfig(4, 4, 8),
    StreamConfig(8, 2, 4),
    StreamConfig(4, 2, 16),
)


def _span(n_words: int, cfg: StreamConfig, sms: int) -> tuple[int, int]:
    """(programs, words per program): about ``programs_per_sm`` programs per SM, spans a multiple of a step."""
    step = cfg.block * cfg.unroll
    per = triton.cdiv(triton.cdiv(n_words, cfg.programs_per_sm * sms), step) * step
    return triton.cdiv(n_words, per), per


def stream_fold(words: torch.Tensor, cfg: StreamConfig = StreamConfig(), pdl: bool = False) -> torch.Tensor:
    """Run the probe over int32 ``words`` (1-D): [programs, block] XOR folds (the result only proves the read).
    pdl: launched with programmatic dependent launch, waiting for its predecessor before any read (sm_90+)."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError(f"want a 1-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    if cfg.unroll not in (1, 2, 4) or cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1):
        raise ValueError(f"bad stream config {cfg}: unroll 1, 2 or 4, num_warps a power of two")
    programs, per = _span(words.numel(), cfg, sm_count(words.device))
    out = torch.empty((max(programs, 1), cfg.block), dtype=torch.int32, device=words.device)
    if words.numel() == 0:
        return out.zero_()
    _stream_kernel[(programs,)](words, out, words.numel(), per, BLOCK=cfg.block, UNROLL=cfg.unroll,
                                num_warps=cfg.num_warps, **pdl_launch(pdl))  # fmt: skip
    return out


def stream_ref(words: torch.Tensor, cfg: StreamConfig = StreamConfig(), sms: int = 1) -> torch.Tensor:
    """The same fold in torch: lane i of program p XORs the words p * span + i + k * block."""
    programs, per = _span(words.numel(), cfg, sms)
    padded = torch.zeros(programs * per, dtype=torch.int32, device=words.device)
    padded[: words.numel()] = words
    lanes = padded.view(programs, per // cfg.block, cfg.block)
    out = lanes[:, 0].clone()
    for k in range(1, lanes.shape[1]):
        out ^= lanes[:, k]
    return out


def stream_traffic(nbytes: int) -> dict[str, float]:
    """Bytes the probe reads (whole 4-byte words) and writes (one fold per lane, negligible)."""
    words = triton.cdiv(nbytes, 4)
    return {"bytes_read": 4 * words, "total_bytes": 4 * words}


def stream_read_ms(nbytes: int, device: str = "cuda", configs=STREAM_CONFIGS, warmup: int = 10, rep: int = 50) -> dict:
    """The measured read ceiling for ``nbytes``: the fastest probe launch (CUDA-graph replay median, L2 flushed
    between replays), its TB/s and its config."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("stream_read_ms needs CUDA")
    words = torch.randint(-(2**31), 2**31 - 1, (triton.cdiv(nbytes, 4),), dtype=torch.int32, device=device)
    best: dict | None = None
    for cfg in configs:
        ms = graph_ms(lambda cfg=cfg: stream_fold(words, cfg), warmup, rep)
        if best is None or ms < best["stream_ms"]:
            best = {"stream_ms": ms, "config": asdict(cfg)}
    assert best is not None
    best["stream_tb_s"] = stream_traffic(nbytes)["bytes_read"] / best["stream_ms"] / 1e9
    return best


CHAIN_CALLS = 20  # launches per graph in the chained timings (stream_chain_us, the W4A16 / FP8 benches' chain_us)
CHAIN_REPLAYS = 15
CHAIN_BYTES = 400_000_000  # distinct buffers cycled through per chain: ~8x the H200's 50 MB L2


def chain_copies(nbytes: int, most: int = 20) -> int:
    """How many distinct buffers of ``nbytes`` a chained timing cycles through so that L2 never serves a re-read:
    enough for CHAIN_BYTES, at least 2, at most ``most``."""
    return max(2, min(most, triton.cdiv(CHAIN_BYTES, max(int(nbytes), 1))))


def stream_chain_us(nbytes: int, device: str = "cuda", configs=STREAM_CONFIGS, pdl: bool = False) -> dict:
    """The load-only read of ``nbytes`` the way a decode step runs its kernels: CHAIN_CALLS launches back to back in
    one CUDA graph over distinct buffers (``graph_sequence_us``), us per launch, the fastest config. Why beside
    ``stream_read_ms``: one launch per replay with L2 flushed carries a fixed cost (graph launch, ramp, tail) that
    a launch in a chain does not (H200 12-12: 46.1 MB 20.48 us alone, 13.70 us per launch chained), and that fixed
    cost, present in a kernel timed the same way, lifts any "% of the ceiling" of a kernel of a few tens of us
    (12-13: the W4A16 gemv's 58.5-64.8 % of one launch are 47.1-56.6 % in a chain). pdl: each launch with PDL,
    every read after its wait: the ceiling for kernels chained with PDL (their launch overlaps the predecessor's
    tail)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("stream_chain_us needs CUDA")
    n = triton.cdiv(int(nbytes), 4)
    bufs = [
        torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device) for _ in range(chain_copies(nbytes))
    ]
    best: dict | None = None
    for cfg in configs:
        us = graph_sequence_us(lambda b, cfg=cfg: stream_fold(b, cfg, pdl), bufs, CHAIN_CALLS, CHAIN_REPLAYS)
        if best is None or us < best["stream_chain_us"]:
            best = {"stream_chain_us": us, "config": asdict(cfg)}
    assert best is not None
    best["stream_chain_tb_s"] = stream_traffic(nbytes)["bytes_read"] / best["stream_chain_us"] / 1e6
    return best


def chain_args(first, make, nbytes: int) -> list:
    """The distinct inputs of a bench's chained timing (``chain_columns``' ``args``): ``first`` (the bench's own
    weights), then ``make(0)``, ``make(1)``, ... for ``chain_copies(nbytes, 12)`` inputs of ``nbytes`` in all."""
    return [first] + [make(i) for i in range(chain_copies(nbytes, 12) - 1)]


def chain_columns(call, args, stream_us: float) -> dict:
    """A bench row's chain columns: ``call(a)`` timed CHAIN_CALLS times back to back over the distinct ``args``
    (us per call), the load-only chain of the same bytes ``stream_us`` (``stream_chain_us``) and the % of it."""
    us = graph_sequence_us(call, args, CHAIN_CALLS, CHAIN_REPLAYS)
    return {"chain_us": us, "stream_chain_us": stream_us, "chain_pct_of_stream": 100.0 * stream_us / us}


def _main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python3 -m perfkit.kernels.stream", description="Load-only DRAM read ceiling by byte count (CUDA)."
    )
    parser.add_argument("--mb", type=float, nargs="+", default=[16, 32, 65, 131, 262], help="sizes in MB (1e6 B)")
    args = parser.parse_args(argv)
    if any(mb <= 0 for mb in args.mb):
        print(f"--mb wants sizes above 0, got {args.mb}; nothing timed.")
        return 2
    if not torch.cuda.is_available():
        print("perfkit.kernels.stream needs a CUDA GPU (none visible); nothing timed.")
        return 2
    for mb in args.mb:
        chain = stream_chain_us(int(mb * 1e6))
        print(json.dumps({"mb": mb, **stream_read_ms(int(mb * 1e6)), "stream_chain_us": chain["stream_chain_us"],
                          "stream_chain_tb_s": chain["stream_chain_tb_s"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
