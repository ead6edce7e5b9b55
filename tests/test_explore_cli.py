"""kvrace explore (kvrace/explore_cli.py), through a parser built here."""
from __future__ import annotations

import json

import pytest

from kvrace.explore_cli import add_parser
from sim.errors import InputError
from sim.executor import run_schedule
from sim.schedule import load
from sim.verdicts import read_digest
from tests.helpers import profile, run_subcommand

UNGATED = "examples/index_k_ungated_race.json"
GATED = "examples/index_k_gated.json"


def run(*argv) -> int:
    return run_subcommand(add_parser, "explore", *argv)


def test_ungated_exits_1_and_lists_clean_and_corrupt_outcomes(capsys):
    assert run(UNGATED, "--exhaustive", "--chunk", "0") == 1
    out, err = capsys.readouterr()
    assert "5 distinct outcomes" in out and "4 corrupt, 1 clean" in out
    assert out.count("CORRUPT") == 4 and out.count("CLEAN") == 1
    assert "STALE" in out and "what it saw" in out and "request 12" in out
    assert "4 of 5 outcomes corrupt: exit 1" in err


def test_gated_twin_exits_0(capsys):
    assert run(GATED) == 0
    assert "0 corrupt, 1 clean" in capsys.readouterr().out


def test_json_and_witness_dir(tmp_path, capsys):
    wd = tmp_path / "witnesses"
    assert run(UNGATED, "--chunk", "0", "--json", "-", "--witness-dir", str(wd)) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["kvrace_explore"] == 1 and rep["complete"] and rep["outcomes_total"] == 5
    files = sorted(wd.iterdir())
    assert len(files) == 5
    s = load(UNGATED)
    for o in rep["outcomes"]:
        path = o["witness"]["path"]
        ws = load(path)                     # a schedule file kvrace schedule run takes unchanged
        r = run_schedule(ws, profile())
        assert {c.op_id: read_digest(c) for c in r.reads} == {x["op"]: x["provenance_sha256"] for x in o["reads"]}
        assert not ws.unbound and ws.name == f"{s.name}.witness"


def test_pct_prints_its_guarantee_and_random_its_frequencies(capsys):
    assert run(UNGATED, "--pct", "10", "--depth", "2", "--chunk", "0") in (0, 1)
    out = capsys.readouterr().out
    assert "each run finds a depth-2 bug with probability >= 1/(n k^(d-1))" in out
    assert run(UNGATED, "--random", "3") == 1
    out = capsys.readouterr().out
    assert "(100.0 % of runs)" in out and "--ties seeded --seed 0" in out


def test_bad_input(tmp_path, capsys):
    with pytest.raises(InputError, match="--depth"):
        run(UNGATED, "--depth", "3")
    with pytest.raises(InputError, match="--max-orders"):
        run(UNGATED, "--random", "2", "--max-orders", "3")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InputError, match="--witness-dir"):
        run(UNGATED, "--witness-dir", str(f))
    with pytest.raises(InputError, match="not found"):
        run(str(tmp_path / "missing.json"))
    for argv in (["--chunk", "-1"], ["--pct", "0"], ["--pct", "2", "--random", "2"]):
        with pytest.raises(SystemExit) as e:
            run(UNGATED, *argv)
        assert e.value.code == 2
