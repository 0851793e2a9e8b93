"""`perfkit generate`: preset with random weights, JSON output, one-line user errors."""

from __future__ import annotations

import json

import pytest

typer_testing = pytest.importorskip("typer.testing")


def test_generate_json_is_deterministic():
    from perfkit.cli import app

    runner = typer_testing.CliRunner()
    args = ["generate", "--model", "tiny", "--prompt-ids", "2,10,11", "--max-new-tokens", "4", "--json"]
    a, b = runner.invoke(app, args), runner.invoke(app, args)
    assert a.exit_code == 0, a.output
    ids = json.loads(a.output)["token_ids"]
    assert len(ids) == 4 and ids == json.loads(b.output)["token_ids"]


def test_generate_bad_model_exits_2():
    from perfkit.cli import app

    res = typer_testing.CliRunner().invoke(app, ["generate", "--model", "nope", "--prompt-ids", "1"])
    assert res.exit_code == 2 and "neither a checkpoint directory nor a preset" in res.output
