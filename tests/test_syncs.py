"""SyncCounter: torch's sync-debug warnings counted per innermost open range, other warnings untouched."""

import warnings
from types import SimpleNamespace

import pytest

from perfkit.capture.ranges import RangeRecorder
from perfkit.capture.syncs import OUTSIDE, SyncCounter

SYNC_MSG = "called a synchronizing CUDA operation"


def fake_torch(modes: list[str]):
    return SimpleNamespace(cuda=SimpleNamespace(set_sync_debug_mode=modes.append))


def test_syncs_attributed_to_the_innermost_range_and_mode_restored():
    rec = RangeRecorder(nvtx=False)
    modes: list[str] = []
    counter = SyncCounter(rec, torch_module=fake_torch(modes))
    with counter:
        assert modes == ["warn"]
        for _ in range(4):  # 4 steps: prepare syncs twice, sample once, one sync outside any range
            with rec.range("step"):
                with rec.range("prepare_inputs"):
                    warnings.warn(SYNC_MSG, UserWarning, stacklevel=1)
                    warnings.warn(SYNC_MSG, UserWarning, stacklevel=1)  # same call site again: counted ("always")
                with rec.range("sample"):
                    warnings.warn(SYNC_MSG, UserWarning, stacklevel=1)
                with rec.range("postprocess"):
                    pass
        warnings.warn(SYNC_MSG, UserWarning, stacklevel=1)
    assert modes == ["warn", "default"]
    s = counter.summary(rec.counts())
    assert s["prepare_inputs"] == {"total": 8, "per_call": 2.0}
    assert s["sample"] == {"total": 4, "per_call": 1.0}
    assert s["postprocess"] == {"total": 0, "per_call": 0.0} and s["step"]["total"] == 0
    assert s[OUTSIDE]["total"] == 1


def test_other_warnings_still_shown_and_handler_restored():
    rec = RangeRecorder(nvtx=False)
    before = warnings.showwarning
    with pytest.warns(DeprecationWarning, match="unrelated"):
        with SyncCounter(rec, torch_module=fake_torch([])) as c:
            warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
    assert warnings.showwarning is before and c.totals == {}


@pytest.mark.gpu
def test_gpu_real_syncs_counted():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rec = RangeRecorder(nvtx=False)
    x = torch.ones(8, device="cuda")
    with SyncCounter(rec) as c:
        with rec.range("reads_back"):
            x.sum().item()
            x.tolist()
        with rec.range("async_only"):
            y = x * 2  # no sync
    assert c.totals.get("reads_back", 0) >= 2 and "async_only" not in c.totals and y.is_cuda
