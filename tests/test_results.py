"""Result schema round trip, atomic flushes, version checks."""

import json
import os

import pytest

from perfkit.errors import PerfkitError
from perfkit.results import (
    Result,
    RunWriter,
    ScenarioResult,
    Stats,
    atomic_write_text,
    make_run_id,
    read_requests,
    read_result,
)


def _result(run_id="20261129-000000-t") -> Result:
    return Result(run_id=run_id, command="perfkit run t.yaml", config={"name": "t"}, provenance={"git": {}})


def _scenario(name="a") -> ScenarioResult:
    return ScenarioResult(name=name, arm={"mask": "triton"}, metrics={"ttft_ms": Stats(n=2, mean=1.0, p50=1.0)})


def test_run_id_is_sortable_and_labelled():
    assert make_run_id("smoke", "x", now=0) == "19700101-000000-smoke-x"
    assert make_run_id("smoke", now=86400) == "19700102-000000-smoke"


def test_writer_round_trips_and_flushes_every_scenario(tmp_path):
    w = RunWriter(tmp_path, _result())
    assert read_result(w.result_path).scenarios == []
    w.add_scenario(_scenario("a"), [{"request_id": 0, "ttft_ms": 1.0}])
    on_disk = read_result(w.dir)  # a directory means its result.json
    assert [s.name for s in on_disk.scenarios] == ["a"] and on_disk.status == "running"
    w.add_scenario(_scenario("b"), [{"request_id": 1, "ttft_ms": 2.0}])
    w.finish("complete")
    back = read_result(w.result_path)
    assert back == w.result and back.status == "complete"
    assert [r["request_id"] for r in read_requests(w.dir)] == [0, 1]


def test_writer_refuses_to_overwrite_a_run(tmp_path):
    RunWriter(tmp_path, _result())
    with pytest.raises(PerfkitError, match="already exists"):
        RunWriter(tmp_path, _result())


def test_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    atomic_write_text(path, '{"old": true}')

    def boom(fd):
        raise KeyboardInterrupt  # the process is interrupted between write and rename

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(path, '{"new": true, "half": ')
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left behind


def test_reader_rejects_unknown_schema_version(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({**_result().model_dump(mode="json"), "schema_version": 99}))
    with pytest.raises(PerfkitError) as err:
        read_result(p)
    assert str(err.value) == (
        f"{p}: result schema_version 99 is not supported by this perfkit (reads 1); use the perfkit version that wrote it"
    )


def test_reader_rejects_garbage(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("{not json")
    with pytest.raises(PerfkitError, match="not valid JSON"):
        read_result(p)
    p.write_text("{}")
    with pytest.raises(PerfkitError, match="no schema_version"):
        read_result(p)
    with pytest.raises(PerfkitError, match="not found"):
        read_result(tmp_path / "missing.json")
