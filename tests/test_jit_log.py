"""JitCompileLog: Triton's compile hooks counted per kernel and innermost range, chained and restored."""

from types import SimpleNamespace

import pytest

from perfkit.capture.jit import OUTSIDE, JitCompileLog
from perfkit.capture.ranges import RangeRecorder


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def compile_once(knobs, clock, name, key, seconds):
    """What Triton's JITFunction._do_compile does around one build: cache hook, build, post-compile hook."""
    fn = SimpleNamespace(name=f"outer.<locals>.{name}", jit_function=object())  # Triton's qualified name
    record = {"signature": {"x_ptr": "*bf16", "T": "i32", "BLOCK": "constexpr"}, "constants": {(2,): 64},
              "configs": [{(0,): [["tt.divisibility", 16]]}], "num_warps": 4, "num_stages": 3}  # fmt: skip
    kw = {"key": key, "repr": f"{name}[num_warps=4]()", "fn": fn, "compile": record, "is_manual_warmup": False,
          "already_compiled": False}  # fmt: skip
    skip = knobs.jit_cache_hook(**kw) if knobs.jit_cache_hook else None
    if skip:
        return
    clock.t += seconds
    if knobs.jit_post_compile_hook:
        knobs.jit_post_compile_hook(**kw)


def test_compiles_counted_per_kernel_and_range_and_hooks_restored():
    calls = []
    prev_before, prev_after = (lambda **kw: calls.append("before")), (lambda **kw: calls.append("after"))
    knobs = SimpleNamespace(jit_cache_hook=prev_before, jit_post_compile_hook=prev_after)
    rec, clock = RangeRecorder(nvtx=False), FakeClock()
    log = JitCompileLog(rec, runtime_knobs=knobs, clock=clock)
    assert log.message() is None
    with log:
        with rec.range("step"), rec.range("forward_prefill"):
            compile_once(knobs, clock, "_moe_gemm_q_kernel", ("a",), 1.5)
            compile_once(knobs, clock, "_moe_gemm_q_kernel", ("b",), 0.5)
        compile_once(knobs, clock, "_rms_norm_kernel", ("c",), 0.25)
    assert knobs.jit_cache_hook is prev_before and knobs.jit_post_compile_hook is prev_after
    assert calls == ["before", "after"] * 3  # the hooks already installed still ran, in order
    compile_once(knobs, clock, "_after_exit", ("d",), 9.0)  # not counted: the log is closed
    s = log.summary()
    assert s["available"] and s["compiles"] == 3 and s["seconds"] == 2.25
    assert list(s["by_kernel"]) == ["_moe_gemm_q_kernel", "_rms_norm_kernel"]  # slowest first
    assert s["by_kernel"]["_moe_gemm_q_kernel"] == {"count": 2, "seconds": 2.0}
    assert s["by_range"] == {"forward_prefill": 2, OUTSIDE: 1}
    assert len(s["first"]) == 3
    assert s["first"][0] == "_moe_gemm_q_kernel[w4 s3](x_ptr: *bf16/16, T: i32, BLOCK=64)"
    msg = log.message()
    assert msg.startswith("3 Triton JIT compile(s), 2.25 s, inside the measured window (_moe_gemm_q_kernel x2")
    assert "warmup_requests" in msg


def test_a_skipping_hook_already_installed_keeps_its_answer():
    """Triton skips the build when its cache hook answers truthy; the log passes that answer through."""
    knobs = SimpleNamespace(jit_cache_hook=lambda **kw: True, jit_post_compile_hook=None)
    clock = FakeClock()
    with JitCompileLog(RangeRecorder(nvtx=False), runtime_knobs=knobs, clock=clock) as log:
        compile_once(knobs, clock, "k", ("a",), 1.0)
    assert log.compiles == 0 and knobs.jit_post_compile_hook is None


def test_without_compile_hooks_the_log_is_inert():
    knobs = SimpleNamespace()  # a Triton without the hooks
    with JitCompileLog(RangeRecorder(nvtx=False), runtime_knobs=knobs) as log:
        pass
    assert log.summary()["available"] is False and log.compiles == 0 and not hasattr(knobs, "jit_cache_hook")


def test_real_triton_hooks_restored():
    from triton import knobs

    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with JitCompileLog(RangeRecorder(nvtx=False)) as log:
        assert knobs.runtime.jit_cache_hook is not before[0]
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before and log.available


@pytest.mark.gpu
def test_a_new_specialisation_compiles_once_and_is_counted():
    """On a GPU: the first call, and the first call with a size that stops being a multiple of 16, compile."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)

    out = torch.empty(64, device="cuda")
    with JitCompileLog(RangeRecorder(nvtx=False)) as log:
        _fill[(1,)](out, 32, BLOCK=64)  # n % 16 == 0
        _fill[(1,)](out, 48, BLOCK=64)  # the same specialisation: no compile
        _fill[(1,)](out, 33, BLOCK=64)  # n % 16 != 0: a second kernel
        torch.cuda.synchronize()
    s = log.summary()
    assert s["compiles"] == 2 and list(s["by_kernel"]) == ["_fill"] and s["seconds"] > 0
    assert "n: i32/16" in s["first"][0] and "n: i32," in s["first"][1], s["first"]  # which argument specialised
