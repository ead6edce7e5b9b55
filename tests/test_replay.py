"""Controlled replay schedules force the simulator's interleaving (CPU-side checks)."""
import json
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import TieBreak, run_reference, run_schedule
from sim.profile import load_profile
from sim.hb import latent_races
from sim.replay import ReplayError, controlled_schedule, plausible_words, possible_provenance
from sim.schedule import load, validate
from sim.verdicts import analyse
from tests.helpers import example_files, profile
from tests.strategies import schedules

P = profile()


def check_controlled(s, prof=P, **kw):
    run = run_schedule(s, prof, torn=False, **kw)
    doc = controlled_schedule(s, run)          # verifies itself; raises on failure
    cs = validate(doc)
    ref = {r.op_id: r.bytes() for r in run_reference(cs).reads}
    for r in run.reads:
        assert np.array_equal(ref[r.op_id], r.bytes())
    # and any timing of the controlled schedule gives the same bytes
    other = run_schedule(cs, profile(launch_us=0.5, h2d_gbps=0.01), torn=False,
                         ties=TieBreak("seeded", seed=5))
    for r in other.reads:
        assert np.array_equal(ref[r.op_id], r.bytes())
    return run, cs


def test_minimal_race_controlled_keeps_the_stale_read():
    s = load("examples/index_k_ungated_race.json")
    run, cs = check_controlled(s)
    ids = [op.id for op in cs.ops]
    # the read saw 0 of 4 items: the copy must start after the read
    assert ids.index("indexer_read_index_k_L0") < ids.index("load_index_k_L0")
    assert not [r for r in latent_races(cs)]


def test_read_in_the_middle_splits_the_copy_at_the_observed_item():
    from tests.helpers import schedule_doc

    # 100 items: the sgl-kernel launcher runs 64 warps, so items 0-63 land in round 0, 64-99 in round 1.
    buffers = schedule_doc([])["buffers"]
    buffers[0]["layout"]["units"] = 128
    buffers[0]["init"][0]["indices"]["count"] = 128
    buffers[1]["layout"]["pages"] = 128
    ops = [{"id": "cp", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": list(range(100)), "dst_indices": list(range(100))}},
           {"op": "compute", "stream": "s1", "duration_us": 5000},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D", "layer": 0, "units": list(range(100))}]
    s = validate(schedule_doc(ops, buffers=buffers))
    # 1 B/us: round 0 (4,096 B) ends near 4,100 us, round 1 near 6,400 us; the read lands between
    run = run_schedule(s, profile(h2d_gbps=0.001, launch_us=0.1), torn=False)
    k = int(np.searchsorted(run.item_end_us["cp"], run.access_us["rd"], side="right"))
    assert k == 64
    doc = controlled_schedule(s, run)
    cs = validate(doc)
    assert [op.id for op in cs.ops if op.op == "copy"] == ["cp#0-64", "cp#64-100"]
    ids = [op.id for op in cs.ops]
    assert ids.index("cp#0-64") < ids.index("rd") < ids.index("cp#64-100")
    ref = {r.op_id: r.bytes() for r in run_reference(cs).reads}
    assert np.array_equal(ref["rd"], run.reads[0].bytes())


def test_overlapping_copies_are_forced_by_when_their_items_landed():
    """The deferred copy-on-write of examples/bugs/mamba_cow_before_load.json is one item over
    every layer, running while the load copies layer after layer: in the item-atomic run it
    lands after layers 0 and 1 and before layer 2 (the h200 profile), so the controlled schedule
    runs it there."""
    from tests.helpers import H200

    s = load("examples/bugs/mamba_cow_before_load.json")
    run, cs = check_controlled(s, H200)
    cow = run.item_end_us["cow_whole_slot"][0]
    landed = [l for l in range(4) if run.item_end_us[f"load_state_L{l}"][0] < cow]
    assert 0 < len(landed) < 4                       # the race happened mid-load
    ids = [op.id for op in cs.ops]
    for l in range(4):
        before = ids.index(f"load_state_L{l}") < ids.index("cow_whole_slot")
        assert before == (l in landed), l
    assert not latent_races(cs)


def test_a_stream_op_listed_before_a_barrier_may_be_issued_after_it():
    """examples/bugs/pd_early_send.json: the transfer host's RDMA copies, issued after the
    hand-over barrier, read the first chunk's pages before the forward's store of them, which
    the scheduler issued before the barrier. A barrier orders hosts, not GPU work, so the
    controlled schedule issues the store after the barrier, behind a wait on the copies."""
    from tests.helpers import H200

    s = load("examples/bugs/pd_early_send.json")
    run, cs = check_controlled(s, H200)
    ids = [op.id for op in cs.ops]
    assert ids.index("send_chunk1@transfer") < ids.index("rdma_chunk1_L1") < ids.index("chunk1_store_kv")
    assert ids.index("chunk1_forward") < ids.index("send_chunk1@host")       # what need not move, stays
    assert {op.host for op in cs.ops if op.id.startswith("rdma_")} == {"transfer"}
    assert not latent_races(cs)


def test_two_overlapping_multi_item_copies_are_refused():
    from tests.helpers import schedule_doc

    # H -> D on s0 and D -> D2 on s1, two items each, both starting at once
    ops = [{"id": "load", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": [0, 1], "dst_indices": [0, 1]}},
           {"id": "cow", "op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "D", "dst": "D2",
            "args": {"layer": 0, "src_indices": [0, 1], "dst_indices": [0, 1]}},
           {"id": "rd", "op": "read", "stream": "s1", "buffer": "D2", "layer": 0, "units": [0, 1]}]
    s = validate(schedule_doc(ops))
    run = run_schedule(s, P, torn=False)
    assert run.item_end_us["load"].size == run.item_end_us["cow"].size == 2
    (sa, ea), (sb, eb) = run.timings["load"], run.timings["cow"]
    assert sa < eb and sb < ea                       # they overlapped
    with pytest.raises(ReplayError, match="overlapped in time"):
        controlled_schedule(s, run)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(max_ops=10), st.integers(0, 1000))
def test_controlled_schedule_reproduces_any_simulated_interleaving(doc, seed):
    s = validate(doc)
    try:
        check_controlled(s, ties=TieBreak("seeded", seed=seed))
    except ReplayError as e:
        # refused only for what events cannot force: overlapping multi-item copies, an order
        # against a host sync, or one the schedule format cannot issue
        assert any(m in str(e) for m in ("overlapped in time", "host syncs", "no valid issue order")), str(e)


def test_torn_runs_are_refused():
    """The torn-read example on the h200 profile: the read lands while all 4
    pages are part-way (0 landed, 4 in flight), so its bytes exist only inside
    items; streams and events can split a copy between items, never inside one,
    so the controlled transform must refuse the run and accept its item-atomic twin."""
    from tests.helpers import H200

    s = load("examples/index_k_torn_read.json")
    run = run_schedule(s, H200, torn=True)
    assert [(c["items_done"], c["items_in_flight"]) for r in run.reads for c in r.in_flight] == [(0, 4)]
    assert analyse(run)["reads"][0]["status"] == "torn"
    with pytest.raises(ReplayError, match="item boundaries"):
        controlled_schedule(s, run)
    controlled_schedule(s, run_schedule(s, H200, torn=False))     # verifies itself


def test_possible_provenance_old_or_new():
    s = load("examples/index_k_ungated_race.json")
    states = possible_provenance(s)["indexer_read_index_k_L0"]
    assert len(states) == 2       # per word: the previous owner's bytes or the copy's (no other writer)
    stale = run_schedule(s, P).reads[0].bytes()
    assert plausible_words(stale, states).all()
    garbage = np.random.default_rng(0).integers(0, 256, stale.size, dtype=np.uint8)
    assert not plausible_words(garbage, states).any()


def test_free_mode_accepts_a_copy_that_reads_its_source_before_an_unordered_copy_lands():
    """host->D on s0 and D->D2 on s1, no event between them: s1's copy may read D
    before s0's copy lands (its items are sampled when they land), so D2 may hold
    D's initial bytes.  The simulator's own run does exactly that (the D->D2 copy
    over HBM finishes long before the PCIe copy), and every word it read must be
    plausible, including D's old bytes."""
    from tests.helpers import schedule_doc

    units = list(range(8))
    ops = [{"id": "h2d", "op": "copy", "stream": "s0", "routine": "kernel_per_layer", "src": "H", "dst": "D",
            "args": {"layer": 0, "src_indices": units, "dst_indices": units}},
           {"id": "d2d", "op": "copy", "stream": "s1", "routine": "kernel_per_layer", "src": "D", "dst": "D2",
            "args": {"layer": 0, "src_indices": units, "dst_indices": units}},
           {"id": "sync", "op": "host_sync"},
           {"id": "rd", "op": "read", "stream": "s2", "buffer": "D2", "layer": 0, "units": units}]
    s = validate(schedule_doc(ops))
    got = run_schedule(s, P).reads[0].bytes()
    old_d = run_reference(validate(schedule_doc([
        {"id": "rd", "op": "read", "stream": "s0", "buffer": "D", "layer": 0, "units": units}]))).reads[0].bytes()
    new_d = run_reference(s).reads[0].bytes()         # issue order: D2 gets H's bytes
    assert np.array_equal(got, old_d) and not np.array_equal(got, new_d)
    states = possible_provenance(s)["rd"]
    assert plausible_words(got, states).all()
    assert plausible_words(new_d, states).all()
    # D2's own initial bytes cannot survive: the D->D2 copy overwrites every word before the sync
    d2_init = run_reference(validate(schedule_doc([
        {"id": "rd", "op": "read", "stream": "s0", "buffer": "D2", "layer": 0, "units": units}]))).reads[0].bytes()
    assert not plausible_words(d2_init, states).any()


@pytest.mark.parametrize("path", example_files())
def test_controlled_schedule_of_every_example_builds_and_verifies(path):
    """Every example, those with named hosts too (a recorded CacheSession run declares only
    'scheduler'): added segments and forcing record/wait pairs are issued by a declared host,
    and the controlled schedule re-simulates to the same reads (``verify``)."""
    s = validate(json.load(open(path)))
    run = run_schedule(s, load_profile("h200"), torn=False)
    doc = controlled_schedule(s, run)
    assert set(validate(doc).hosts) == set(s.hosts)
