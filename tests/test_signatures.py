"""`kvrace signatures`: the A/B matrix, its scoring, and the shipped incident matrix's data."""
from __future__ import annotations

import json

import pytest

from kvrace.cli import main
from sim.engine.signatures import ab_matrix_from_dict, load_ab_matrix, run_signatures
from sim.errors import InputError

SMALL = """
scenario = "glm5-22811-small"
[[column]]
name = "on / C=4"
set = ["run.layers=2"]
observed = { fraction = 0.3, low = 0.1, high = 0.5 }
[[column]]
name = "off / C=4"
set = ["run.layers=2", "hicache.prefill=false", "hicache.decode=false"]
observed = { fraction = 0.0 }
[[column]]
name = "on / C=1"
set = ["run.layers=2", "workload.concurrency=1"]
[[column]]
name = "fixed"
set = ["run.layers=2"]
fixed = true
observed = { fraction = 0.0 }
"""


@pytest.fixture(scope="module")
def small_matrix(tmp_path_factory):
    p = tmp_path_factory.mktemp("ab") / "small.toml"
    p.write_text(SMALL)
    return p


@pytest.fixture(scope="module")
def table(small_matrix):
    # the 0.5.10 gate map races with hypothesis none; ungated-index-k changes nothing more on it
    return run_signatures(str(small_matrix), overrides=["variant.gate_map=upstream-0.5.10"],
                          hypotheses=["none", "load-unfenced"], workers=1)


def test_cells_score_and_fit(table):
    rows = {r.hypothesis: r for r in table.rows}
    none = rows["none"]
    on, off, c1, fixed = none.cells
    assert on.corrupted > 0 and on.ci[0] > 0 and on.requests > 0
    assert off.corrupted == 0 and off.load_backs == 0
    # the fixed column runs hypothesis none: for the row none it is the same run as column 0
    assert fixed == on
    assert none.matched == [True, True, None, False] and none.score == pytest.approx(2 / 3) and not none.fits
    # runs are shared: the fixed column of every row is one run, and equal scenarios too
    assert table.runs < len(table.rows) * len(table.columns)


def test_workers_do_not_change_the_table(small_matrix, table):
    t2 = run_signatures(str(small_matrix), overrides=["variant.gate_map=upstream-0.5.10"],
                        hypotheses=["none", "load-unfenced"], workers=2)
    strip = lambda d: {k: v for k, v in d.items() if k != "wall_time_s"}
    assert strip(t2.to_dict()) == strip(table.to_dict())


def test_cli_json_and_table(small_matrix, capsys, tmp_path):
    out = tmp_path / "sig.json"
    rc = main(["signatures", str(small_matrix), "--hypotheses", "none", "--set", "variant.gate_map=upstream-0.5.11",
               "--workers", "1", "--json", str(out), "--progress", "never"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hypothesis" in text and "observed" in text and "fits the observations" in text
    d = json.loads(out.read_text())
    assert [c["name"] for c in d["columns"]] == ["on / C=4", "off / C=4", "on / C=1", "fixed"]
    assert d["observed"][2]["fraction"] is None
    # 0.5.11 gates every index-K reader: nothing corrupts, so the corrupt observation is missed
    row = d["rows"][0]
    assert all(c["corrupted"] == 0 for c in row["cells"]) and row["matched"][0] is False


def test_shipped_incident_matrix_is_the_incident_table():
    m = load_ab_matrix("incident")
    by = {c.name: c for c in m.columns}
    assert m.scenario == "incident-short" and len(m.columns) == 9
    assert by["bf16 / on / C=high"].observed.corrupt
    assert 0.12 <= by["bf16 / on / C=high"].observed.fraction <= 0.18
    assert by["fp8 / off / C=high"].observed is None
    clean = [c for c in m.columns if c.observed is not None and not c.observed.corrupt]
    assert len(clean) == 7 and by["fixed (bf16 / on / C=high)"].fixed


@pytest.mark.parametrize("doc, key", [
    ({"column": [{"name": "a"}]}, "ab.scenario"),
    ({"scenario": "x", "column": []}, "ab.column"),
    ({"scenario": "x", "column": [{"name": "a", "set": ["nokey"]}]}, "ab.column[0].set"),
    ({"scenario": "x", "column": [{"name": "a", "observed": {"fraction": 2}}]}, "ab.column[0].observed.fraction"),
    ({"scenario": "x", "column": [{"name": "a", "colour": 1}]}, "colour"),
    ({"scenario": "x", "column": [{"name": "a"}, {"name": "a"}]}, "distinct"),
])
def test_bad_matrix_names_the_key(doc, key):
    with pytest.raises(InputError, match=key.replace("[", r"\[").replace("]", r"\]")):
        ab_matrix_from_dict(doc)


def test_bad_override_names_the_column(small_matrix):
    with pytest.raises(InputError, match=r"small.column\[0\].*workload.nope"):
        run_signatures(str(small_matrix), overrides=["workload.nope=1"], hypotheses=["none"], workers=1)
    with pytest.raises(InputError, match="hypotheses"):
        run_signatures(str(small_matrix), hypotheses=["no-such"], workers=1)
    with pytest.raises(InputError, match="matrix"):
        load_ab_matrix("no-such-matrix")
