"""Triton JIT compiles inside a measured window: how many, how long, which kernels, under which engine range.

    with JitCompileLog(recorder) as log:      # recorder: the RangeRecorder whose ranges wrap the engine phases
        ... run the scenario ...
    log.summary()   # {"compiles": 2, "seconds": 1.93, "by_kernel": {...}, "by_range": {...}, "first": [...]}

Why: Triton builds a kernel the first time it meets a new specialisation: other constexprs, an integer argument
that newly equals 1 or stops (or starts) being a multiple of 16, a pointer that is not 16-byte aligned. A prefill
whose token count first leaves those classes inside the measured window stalls the host for the compile, and the
stall lands in that step, in TTFT and in throughput. The warmup requests are meant to take every such first call;
when they miss one, the result says so here instead of carrying a silent outlier. A load from Triton's on-disk
cache also counts (it takes milliseconds, not seconds), as it is a first call in this process all the same.

It uses Triton's own hooks (``triton.knobs.runtime.jit_cache_hook``, called before a kernel is built or loaded,
and ``jit_post_compile_hook``, after), chained to any hook already installed and restored on exit. Kernels run
under ``TRITON_INTERPRET=1`` are never compiled, so on a CPU the log stays empty.
"""

from __future__ import annotations

import time
from typing import Any

OUTSIDE = "(outside ranges)"
FIRST_KEPT = 4  # compiles whose full signature is kept, for finding the argument that specialised


def _triton_runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # no triton, or one older than its knobs module (3.4)
        return None
    return getattr(knobs, "runtime", None)


class JitCompileLog:
    def __init__(self, ranges: Any, runtime_knobs: Any = None, clock=time.perf_counter):
        self.ranges = ranges  # needs `open_ranges` (RangeRecorder); a disabled recorder has none open
        self._knobs = runtime_knobs
        self._clock = clock
        self._started: dict[Any, tuple[float, str]] = {}
        self._prev: tuple[Any, Any] = (None, None)
        self.available = False
        self.by_kernel: dict[str, dict[str, float]] = {}
        self.by_range: dict[str, int] = {}
        self.first: list[str] = []

    def _range(self) -> str:
        open_ = getattr(self.ranges, "open_ranges", None) or []
        return open_[-1] if open_ else OUTSIDE

    def _before(self, *args: Any, **kw: Any) -> Any:
        self._started[_hook_key(kw)] = (self._clock(), self._range())
        prev = self._prev[0]
        return prev(*args, **kw) if prev is not None else None  # a truthy answer makes Triton skip the build

    def _after(self, *args: Any, **kw: Any) -> Any:
        t0, where = self._started.pop(_hook_key(kw), (self._clock(), self._range()))
        name = _kernel_name(kw)
        k = self.by_kernel.setdefault(name, {"count": 0, "seconds": 0.0})
        k["count"] += 1
        k["seconds"] += self._clock() - t0
        self.by_range[where] = self.by_range.get(where, 0) + 1
        if len(self.first) < FIRST_KEPT:
            self.first.append(_signature(name, kw)[:600])
        prev = self._prev[1]
        return prev(*args, **kw) if prev is not None else None

    def __enter__(self) -> JitCompileLog:
        if self._knobs is None:
            self._knobs = _triton_runtime_knobs()
        k = self._knobs
        if k is not None and hasattr(k, "jit_cache_hook") and hasattr(k, "jit_post_compile_hook"):
            self._prev = (k.jit_cache_hook, k.jit_post_compile_hook)
            k.jit_cache_hook, k.jit_post_compile_hook = self._before, self._after
            self.available = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev

    @property
    def compiles(self) -> int:
        return int(sum(k["count"] for k in self.by_kernel.values()))

    def summary(self) -> dict[str, Any]:
        """Counts and seconds per kernel (slowest first), compiles per innermost engine range, the first few
        signatures; ``available`` False where this Triton has no compile hooks (nothing could be seen)."""
        kernels = sorted(self.by_kernel.items(), key=lambda kv: -kv[1]["seconds"])
        return {
            "available": self.available,
            "compiles": self.compiles,
            "seconds": round(sum(k["seconds"] for k in self.by_kernel.values()), 4),
            "by_kernel": {n: {"count": int(k["count"]), "seconds": round(k["seconds"], 4)} for n, k in kernels},
            "by_range": dict(sorted(self.by_range.items())),
            "first": list(self.first),
        }

    def message(self) -> str | None:
        """One line for the scenario's result when the measured window compiled anything, else None."""
        if not self.compiles:
            return None
        s = self.summary()
        names = ", ".join(f"{n} x{k['count']}" for n, k in list(s["by_kernel"].items())[:3])
        more = "" if len(s["by_kernel"]) <= 3 else f" and {len(s['by_kernel']) - 3} more"
        return (
            f"{s['compiles']} Triton JIT compile(s), {s['seconds']:.2f} s, inside the measured window ({names}{more}; "
            f"runtime.jit_compiles has their signatures): the warmup missed a kernel shape, so the steps that "
            f"compiled include the compile; raise warmup_requests"
        )


def _hook_key(kw: dict[str, Any]) -> Any:
    """What pairs a post-compile call with its pre-compile call: the kernel and its specialisation key."""
    fn = kw.get("fn")
    key = kw.get("key")
    try:
        hash(key)
    except TypeError:
        key = repr(key)
    return (id(getattr(fn, "jit_function", fn)), key)


def _kernel_name(kw: dict[str, Any]) -> str:
    """The kernel's own name (Triton gives its qualified name: a kernel defined in a function has a dotted one)."""
    fn = kw.get("fn")
    name = str(getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0])
    return name.rsplit(".", 1)[-1]


def _signature(name: str, kw: dict[str, Any]) -> str:
    """``name[w4 s3](a_ptr: *bf16/16, T: i32, BLOCK_M=16, ...)`` from the hook's ``compile`` record: each
    argument's type, ``/16`` where Triton took it as divisible by 16, ``=v`` for constexprs (an integer argument
    equal to 1 is one too), so two compiles of one kernel show which argument specialised. Triton's own ``repr``
    is the fallback (its argument list is empty in some versions)."""
    c = kw.get("compile") or {}
    sig = c.get("signature")
    if not isinstance(sig, dict):
        return str(kw.get("repr", name))
    consts = c.get("constants") or {}
    attrs = (c.get("configs") or [{}])[0] or {}
    parts = []
    for i, (arg, ty) in enumerate(sig.items()):
        if (i,) in consts:
            parts.append(f"{arg}={consts[(i,)]}")
        else:
            div = any("divisibility" in str(a) for a in attrs.get((i,), ()))
            parts.append(f"{arg}: {ty}{'/16' if div else ''}")
    return f"{name}[w{c.get('num_warps', '?')} s{c.get('num_stages', '?')}]({', '.join(parts)})"
