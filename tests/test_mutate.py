"""kvrace mutate (sim/explore/mutate.py, kvrace/mutate_cli.py): one synchronisation removed at a time."""
from __future__ import annotations

import json

import pytest

from kvrace.mutate_cli import add_parser
from sim.errors import InputError
from sim.explore.mutate import mutate_scenario, mutate_schedule, schedule_mutants
from sim.schedule import load, validate
from tests.helpers import run_subcommand

GATED = "examples/index_k_gated.json"
UNGATED = "examples/index_k_ungated_race.json"


def run(*argv) -> int:
    return run_subcommand(add_parser, "mutate", *argv)


@pytest.fixture(scope="module")
def gated_report():
    return mutate_schedule(load(GATED), trials=10)


def _two_host_doc(sync: str) -> dict:
    """The gated example's load on host ``host``; the read issued by host ``reader`` on its own
    stream after a barrier, ordered after the load only through ``host``'s ``sync``
    (``host_sync`` or a positive ``host_query`` of the layer event) and the barrier."""
    doc = json.load(open(GATED))
    ops = [o for o in doc["ops"] if o.get("op") in ("record", "wait", "copy") and o.get("id") != "wait_until_L0"]
    ops = [o for o in ops if not (o.get("op") == "record" and o.get("stream") == "forward")]
    ops = [o for o in ops if o.get("op") != "wait"]
    host_op = ({"id": "sync_L0", "op": "host_sync", "event": "layer0_loaded"} if sync == "host_sync" else
               {"id": "sync_L0", "op": "host_query", "event": "layer0_loaded", "outcome": True})
    read = next(o for o in doc["ops"] if o.get("op") == "read")
    doc.update(kvrace_schedule=2, hosts=["host", "reader"], streams=["forward", "load", "reader_stream"])
    doc["ops"] = ops + [host_op,
                        {"id": "step_barrier_host", "op": "barrier", "barrier": "step", "hosts": ["host", "reader"]},
                        {"id": "step_barrier_reader", "op": "barrier", "barrier": "step",
                         "hosts": ["host", "reader"], "host": "reader"},
                        {**read, "stream": "reader_stream", "host": "reader"}]
    return doc


# ---------------------------------------------------------------- the gated minimal race

def test_gated_example_removing_the_wait_is_detected_by_race_and_outcome(gated_report):
    rep = gated_report
    by = {m.name: m for m in rep.mutants}
    assert sorted(by) == sorted(["-record start_event", "-wait op1", "-record complete_L0",
                                 "-wait wait_until_L0"])
    m = by["-wait wait_until_L0"]
    assert m.latent_race and m.corrupt_explored and m.detected and m.explore_complete
    assert ["dev_index_k", "load_index_k_L0", "indexer_read_index_k_L0"] in m.new_races
    # 13 outcomes with 4 KiB chunks: the clean one, 4 stale, 8 torn (docs/explore.md)
    assert (m.outcomes, m.corrupt_outcomes) == (13, 12)
    assert m.probability == 1.0 and m.probability_ci[0] > 0.6
    assert not rep.original.corrupt_explored and rep.original.probability == 0.0


def test_gated_example_score_and_equivalent_mutants(gated_report):
    rep = gated_report
    assert (len(rep.mutants), rep.detected, rep.equivalent) == (4, 2, 2)
    assert rep.score == 0.5 and rep.score_non_equivalent == 1.0
    eq = {m.name for m in rep.mutants if m.equivalent}
    # the load's wait on start_loading orders it after nothing that touches bytes: removing it
    # (or its record, which leaves the wait unbound) changes no read in any order
    assert eq == {"-record start_event", "-wait op1"}
    for m in rep.mutants:
        if m.equivalent:
            assert m.explore_complete and not m.reads_changed and not m.latent_race and m.outcomes == 1


def test_every_mutant_that_can_change_a_read_is_detected(gated_report):
    """The issue's requirement, checked across the two analyses: every mutant whose explored
    outcomes give some read bytes the original cannot give has a corrupt outcome, a new latent
    race, and is detected; a mutant whose reads never change is never reported corrupt."""
    for m in gated_report.mutants:
        assert m.reads_changed == m.corrupt_explored
        if m.reads_changed:
            assert m.detected and m.latent_race
        if m.corrupt_explored:
            assert m.detected
        assert m.status in ("detected", "equivalent")


def test_removing_a_record_leaves_its_wait_unbound():
    s = load(GATED)
    m = next(x for x in schedule_mutants(s) if x.name == "-record complete_L0")
    assert m.rebound == ("wait_until_L0",)
    assert [u["op"] for u in m.schedule.unbound] == ["wait_until_L0"]
    assert "complete_L0" not in {o.id for o in m.schedule.ops}
    assert len(m.schedule.ops) == len(s.ops) - 1


def test_racy_original_compares_outcomes_with_its_own():
    """The ungated race is corrupt already: a mutant is charged only with what is new."""
    rep = mutate_schedule(load(UNGATED), trials=0, chunk_bytes=0)
    assert rep.original.corrupt_explored and rep.original.corrupt_outcomes == 4
    assert rep.detected == 0 and all(m.equivalent for m in rep.mutants)
    assert rep.original.probability is None


# ---------------------------------------------------------------- host syncs, queries, barriers

@pytest.mark.parametrize("sync", ["host_sync", "host_query"])
def test_host_sync_query_and_barrier_mutants(sync):
    s = validate(_two_host_doc(sync))
    rep = mutate_schedule(s, trials=0, chunk_bytes=0)
    by = {m.name: m for m in rep.mutants}
    assert set(by) == {"-record complete_L0", f"-{sync} sync_L0", "-barrier step"}
    assert not rep.original.latent_race and not rep.original.corrupt_explored
    assert by["-barrier step"].removed == ["step_barrier_host", "step_barrier_reader"]
    for m in rep.mutants:
        assert m.detected and m.latent_race and m.corrupt_explored, m.name
    assert rep.score == 1.0


def test_negative_query_left_without_record_reports_complete():
    doc = _two_host_doc("host_sync")
    doc["ops"].insert(-3, {"id": "peek", "op": "host_query", "event": "layer0_loaded", "outcome": False})
    # a negative query issued after the record is legal, and no mutant of its own
    s = validate(doc)
    ms = {m.name: m for m in schedule_mutants(s)}
    assert "-host_query peek" not in ms
    m = ms["-record complete_L0"]
    assert m.rewritten == ("peek",) and next(o for o in m.schedule.ops if o.id == "peek").outcome is True


# ---------------------------------------------------------------- CLI

def test_cli_table_and_json(capsys, tmp_path):
    assert run(GATED, "--trials", "5") == 0
    out = capsys.readouterr().out
    assert "mutation score 2/4 = 0.50 (2 equivalent, 0 missed" in out
    assert "-wait wait_until_L0" in out and "detected" in out
    path = tmp_path / "m.json"
    assert run(GATED, "--trials", "0", "--chunk", "0", "--json", str(path)) == 0
    d = json.loads(path.read_text())
    assert d["kvrace_mutate"] == 1 and d["score"] == 0.5 and d["mutants_total"] == 4
    capsys.readouterr()
    assert run(GATED, "--trials", "0", "--json", "-") == 0
    assert json.loads(capsys.readouterr().out)["detected"] == 2


@pytest.mark.parametrize("argv, key", [
    ([GATED, "--set", "run.layers=2"], "--set"),
    ([GATED, "--workers", "2"], "--workers"),
    (["no/such/schedule.json"], ""),
    (["glm5-22811-small", "--set", "hicache.bogus=1"], "hicache.bogus"),
    (["no-such-preset"], "scenario"),
    (["glm5-22811-small", "--trials", "0"], "--trials"),
])
def test_bad_input_names_the_key(argv, key):
    with pytest.raises(InputError) as e:
        run(*argv)
    assert e.value.where == key


def test_bad_counts_name_the_argument():
    with pytest.raises(InputError, match="max_orders"):
        mutate_schedule(load(GATED), max_orders=0)
    with pytest.raises(InputError, match="trials"):
        mutate_schedule(load(GATED), trials=-1)


# ---------------------------------------------------------------- scenario mutants (engine runs)

SMALL = ["run.layers=2", "variant.gate_map=upstream-0.5.11"]


@pytest.mark.slow
def test_scenario_ungating_the_topk_ragged_accessor_corrupts_requests():
    rep = mutate_scenario("glm5-22811-small", SMALL, trials=1)
    by = {m.name: m for m in rep.mutants}
    assert rep.original.corrupted == [0] and rep.original.races == [0]
    # dsa-v3.2 on the CUDA indexer path reads index-K first in _get_topk_ragged, whose only
    # accessor is get_index_k_scale_buffer: one of the three 0.5.10 ungated
    m = by["-gate get_index_k_scale_buffer"]
    assert m.detected and m.corrupted[0] > 0 and m.races[0] > 0
    # accessors the DSA model never calls alone (V4 getters; the non-CUDA indexer's pair) are
    # equivalent by construction
    for acc in ("get_swa_key_buffer", "get_extra_key_buffer", "get_index_k_continuous"):
        assert not by[f"-gate {acc}"].run and by[f"-gate {acc}"].status == "equivalent"
    assert "-load_fence" in by and by["-load_fence"].run


@pytest.mark.slow
def test_scenario_equivalent_mutants_when_run_show_nothing_and_workers_do_not_matter():
    one = mutate_scenario("glm5-22811-small", SMALL, trials=1, run_all=True)
    for m in one.mutants:
        assert m.run
        if m.reason:                      # equivalent by construction: the base's numbers
            assert m.corrupted == one.original.corrupted == [0] and m.races == [0] and not m.detected
    two = mutate_scenario("glm5-22811-small", SMALL, trials=1, run_all=True, workers=2)
    assert two.to_json() == one.to_json()


@pytest.mark.slow
def test_scenario_cli(capsys):
    assert run("glm5-22811-small", "--set", "run.layers=2", "--set", "variant.gate_map=upstream-0.5.11") == 0
    out = capsys.readouterr().out
    assert "-gate get_index_k_scale_buffer" in out and "mutation score" in out
