"""Workloads: multi-turn sessions, prefix sharing, concurrency bookkeeping, seeds, trace replay."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.engine.workload import (SESSION_TAG_TOKENS, Request, Workload, WorkloadDriver, WorkloadSpec, load_trace,
                                 output_tokens, tokens, workload_digest)


def small(**kw) -> WorkloadSpec:
    base = dict(concurrency=3, sessions=6, first_turn_tokens=64, max_context_tokens=600, user_tokens_min=20,
                user_tokens_max=60, output_tokens_min=5, output_tokens_max=15, vocab_size=1000)
    base.update(kw)
    return WorkloadSpec.from_dict(base)


def fixed_latency(req: Request) -> int:
    return 1000 + 10 * req.output_len


# ---------------------------------------------------------------- prefix sharing and growth

def test_each_turn_starts_with_the_previous_turn_and_its_output():
    reqs = Workload(small(), seed=3).simulate(fixed_latency)
    by = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    assert len(by) == 6
    for turns in by.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:]):
            prev = np.concatenate([tokens(a), output_tokens(a)])
            cur = tokens(b)
            assert b.prefix_len == a.input_len + a.output_len
            assert b.input_len > b.prefix_len               # new user tokens follow
            assert np.array_equal(cur[:len(prev)], prev)
            assert cur.dtype == np.int64


def test_sessions_share_only_the_system_prompt():
    spec = small(system_prompt_tokens=32, sessions=5, concurrency=5)
    reqs = Workload(spec, seed=1).simulate(fixed_latency)
    firsts = [r for r in reqs if r.turn == 0]
    arrays = [tokens(r) for r in firsts]
    for i, a in enumerate(arrays):
        assert ((0 <= a) & (a < spec.vocab_size)).all()
        for b in arrays[i + 1:]:
            assert np.array_equal(a[:32], b[:32])
            assert a[32] != b[32] or a[33] != b[33]          # the session tag differs right after it


def test_no_system_prompt_means_no_shared_first_token_pair():
    reqs = Workload(small(sessions=40, concurrency=40), seed=0).simulate(fixed_latency)
    heads = {tuple(tokens(r)[:SESSION_TAG_TOKENS]) for r in reqs if r.turn == 0}
    assert len(heads) == 40


def test_contexts_grow_to_the_cap_and_no_further():
    spec = small(max_context_tokens=2000)
    reqs = Workload(spec, seed=5).simulate(fixed_latency)
    by = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    for turns in by.values():
        assert all(r.input_len + r.output_len <= spec.max_context_tokens for r in turns)
        last = turns[-1]
        assert last.last_turn and not any(r.last_turn for r in turns[:-1])
        # one more turn (smallest draw) would not have fitted
        assert last.input_len + last.output_len + spec.user_tokens_min + spec.output_tokens_min \
            > spec.max_context_tokens
        assert 0.75 * spec.first_turn_tokens <= turns[0].input_len <= 1.25 * spec.first_turn_tokens


def test_incident_scale_growth_stays_cheap():
    """60 sessions growing 2k -> 80k: the requests are descriptions, not arrays."""
    spec = WorkloadSpec.from_dict({"concurrency": 60, "sessions": 60})
    reqs = Workload(spec, seed=0).simulate(lambda r: 50_000)
    assert max(r.input_len for r in reqs) > 70_000
    assert min(r.input_len for r in reqs if r.turn == 0) < 3_000
    assert all(not hasattr(r, "__dict__") or "ids" not in r.__dict__ for r in reqs)
    big = max(reqs, key=lambda r: r.input_len)
    assert tokens(big).shape == (big.input_len,)


def test_max_turns_caps_a_session():
    reqs = Workload(small(max_turns=2), seed=0).simulate(fixed_latency)
    assert max(r.turn for r in reqs) == 1


# ---------------------------------------------------------------- concurrency bookkeeping

def run_driver(spec, seed=0, latency=fixed_latency, until_us=None):
    """Drive by hand, checking the in-flight invariant at every step."""
    d = WorkloadDriver(Workload(spec, seed=seed), until_us=until_us)
    pending = sorted(d.start(0), key=lambda r: (r.arrival_us, r.rid))
    out, in_flight_sessions = [], set()
    import heapq
    heap = []
    for r in pending:
        heapq.heappush(heap, (r.arrival_us + latency(r), r.rid, r))
    while heap:
        t, _, r = heapq.heappop(heap)
        out.append(r)
        assert len(d.active_sessions) <= spec.concurrency
        for nr in d.complete(r.rid, t):
            assert nr.arrival_us >= t
            heapq.heappush(heap, (nr.arrival_us + latency(nr), nr.rid, nr))
        in_flight_sessions.add(r.session)
    return d, out


def test_at_most_c_sessions_in_flight_and_replacements_start_when_one_ends():
    spec = small(concurrency=2, sessions=5)
    d, reqs = run_driver(spec)
    assert d.done and d.sessions_started == 5 and d.sessions_finished == 5
    # in-flight intervals of sessions never exceed 2 at once
    spans = {}
    for r in reqs:
        s, e = spans.get(r.session, (r.arrival_us, 0))
        spans[r.session] = (min(s, r.arrival_us), max(e, r.arrival_us + fixed_latency(r)))
    points = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()],
                    key=lambda x: (x[0], x[1]))
    level = 0
    for _, dl in points:
        level += dl
        assert level <= 2
    # sessions 2, 3, 4 each start exactly when an earlier session ends (closed loop, no think)
    ends = sorted(e for s, (_, e) in spans.items() if s < 4)
    for s in (2, 3, 4):
        assert spans[s][0] in ends


def test_one_turn_at_a_time_per_session():
    d = WorkloadDriver(Workload(small(concurrency=1, sessions=1), seed=0))
    [r0] = d.start(0)
    assert r0.turn == 0 and d.active_sessions == {0}
    with pytest.raises(InputError, match="rid"):
        d.complete(r0.rid + 99, 10)
    [r1] = d.complete(r0.rid, 500)
    assert (r1.session, r1.turn, r1.arrival_us) == (0, 1, 500)
    with pytest.raises(InputError, match="already completed|not in flight"):
        d.complete(r0.rid, 600)


def test_think_time_delays_the_next_turn():
    d = WorkloadDriver(Workload(small(concurrency=1, sessions=1, think_time_s=2.0), seed=4))
    [r0] = d.start(0)
    [r1] = d.complete(r0.rid, 100)
    assert r1.arrival_us > 100
    # same draws in a second run
    d2 = WorkloadDriver(Workload(small(concurrency=1, sessions=1, think_time_s=2.0), seed=4))
    [q0] = d2.start(0)
    [q1] = d2.complete(q0.rid, 100)
    assert q1.arrival_us == r1.arrival_us


def test_duration_stops_new_sessions_and_turns():
    spec = small(concurrency=2, sessions=0)
    d, reqs = run_driver(spec, until_us=20_000)
    assert all(r.arrival_us < 20_000 for r in reqs)
    assert d.done and d.sessions_started >= 2


def test_poisson_arrivals_respect_rate_and_cap():
    spec = small(arrival="poisson", arrival_rate_per_s=1000.0, concurrency=4, sessions=40)
    d, reqs = run_driver(spec, latency=lambda r: 100)
    starts = sorted(r.arrival_us for r in reqs if r.turn == 0)
    assert len(starts) == 40
    mean_gap = (starts[-1] - starts[0]) / 39
    assert 300 < mean_gap < 3000                    # about 1000 us apart
    w = Workload(spec, seed=0)
    assert [w.session_arrival_us(i) for i in range(3)] == sorted(w.session_arrival_us(i) for i in range(3))


def test_unbounded_workload_needs_a_duration():
    with pytest.raises(InputError, match="sessions"):
        WorkloadDriver(Workload(small(sessions=0), seed=0))


@settings(max_examples=25, deadline=None)
@given(c=st.integers(1, 5), n=st.integers(1, 8), seed=st.integers(0, 2**32),
       lat=st.integers(1, 5000))
def test_driver_invariants(c, n, seed, lat):
    spec = small(concurrency=c, sessions=n, max_context_tokens=400)
    d, reqs = run_driver(spec, seed=seed, latency=lambda r: lat)
    assert d.done and d.sessions_finished == n
    assert len({r.rid for r in reqs}) == len(reqs)
    assert {r.session for r in reqs} == set(range(n))


# ---------------------------------------------------------------- determinism

def test_same_seed_same_workload_other_seed_other():
    a = workload_digest(Workload(small(), seed=7).simulate(fixed_latency))
    b = workload_digest(Workload(small(), seed=7).simulate(fixed_latency))
    c = workload_digest(Workload(small(), seed=8).simulate(fixed_latency))
    assert a == b != c


def test_digest_is_the_same_in_another_process():
    code = ("from sim.engine.workload import Workload, WorkloadSpec, workload_digest\n"
            "from tests.test_workload import small, fixed_latency\n"
            "print(workload_digest(Workload(small(system_prompt_tokens=16), seed=11).simulate(fixed_latency)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    here = workload_digest(Workload(small(system_prompt_tokens=16), seed=11).simulate(fixed_latency))
    assert out.stdout.strip() == here


def test_session_plan_does_not_depend_on_timing():
    a = Workload(small(), seed=2).simulate(lambda r: 10)
    b = Workload(small(), seed=2).simulate(lambda r: 10_000 + 37 * r.rid)
    key = lambda rs: sorted((r.session, r.turn, r.input_len, r.output_len) for r in rs)  # noqa: E731
    assert key(a) == key(b)


# ---------------------------------------------------------------- spec validation

@pytest.mark.parametrize("d,key", [
    ({"concurrency": 0}, "workload.concurrency"),
    ({"concurrency": 2.5}, "workload.concurrency"),
    ({"concurrency": True}, "workload.concurrency"),
    ({"arrival": "bursty"}, "workload.arrival"),
    ({"think_time_s": -1}, "workload.think_time_s"),
    ({"think_time_s": float("nan")}, "workload.think_time_s"),
    ({"user_tokens_min": 10, "user_tokens_max": 5}, "workload.user_tokens_max"),
    ({"output_tokens_min": 0}, "workload.output_tokens_min"),
    ({"system_prompt_tokens": 4000, "first_turn_tokens": 2048}, "workload.first_turn_tokens"),
    ({"max_context_tokens": 1000, "first_turn_tokens": 2048}, "workload.max_context_tokens"),
    ({"vocab_size": 1}, "workload.vocab_size"),
    ({"kind": "trace"}, "workload.trace"),
    ({"trace": "x.jsonl"}, "workload.trace"),
    ({"bogus": 1}, "workload.bogus"),
])
def test_bad_specs_name_the_key(d, key):
    with pytest.raises(InputError) as e:
        WorkloadSpec.from_dict(d)
    assert e.value.where == key


# ---------------------------------------------------------------- trace replay

def write_trace(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_trace_replay(tmp_path):
    path = write_trace(tmp_path, [
        {"session": "a", "turn": 0, "input_tokens": 100, "output_tokens": 10},
        {"session": "b", "turn": 0, "input_tokens": 50, "output_tokens": 5, "arrival_s": 0.5},
        "",
        {"session": "a", "turn": 1, "input_tokens": 130, "output_tokens": 20},
    ])
    spec = WorkloadSpec.from_dict({"kind": "trace", "trace": path, "concurrency": 2, "vocab_size": 500})
    w = Workload(spec, seed=0)
    assert w.n_sessions == 2 and w.session_names == ("a", "b")
    reqs = w.simulate(lambda r: 1000)
    got = sorted((r.session, r.turn, r.input_len, r.output_len) for r in reqs)
    assert got == [(0, 0, 100, 10), (0, 1, 130, 20), (1, 0, 50, 5)]
    b0 = next(r for r in reqs if r.session == 1)
    assert b0.arrival_us == 500_000
    a0, a1 = sorted((r for r in reqs if r.session == 0), key=lambda r: r.turn)
    assert np.array_equal(tokens(a1)[:110], np.concatenate([tokens(a0), output_tokens(a0)]))


@pytest.mark.parametrize("lines,where,match", [
    (["{not json"], "t.jsonl:1", "JSON"),
    (["[1, 2]"], "t.jsonl:1", "object"),
    ([{"session": "a", "turn": 0, "input_tokens": 10}], "t.jsonl:1.output_tokens", "missing"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 1, "x": 1}], "t.jsonl:1.x", "unknown"),
    ([{"session": "a", "turn": 0, "input_tokens": "10", "output_tokens": 1}], "t.jsonl:1.input_tokens", "integer"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 0}], "t.jsonl:1.output_tokens", ">= 1"),
    ([{"session": 1.5, "turn": 0, "input_tokens": 10, "output_tokens": 1}], "t.jsonl:1.session", "string"),
    ([{"session": "a", "turn": 1, "input_tokens": 10, "output_tokens": 1}], "t.jsonl:1.turn", "turn 0"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 5},
      {"session": "a", "turn": 1, "input_tokens": 12, "output_tokens": 1}], "t.jsonl:2.input_tokens", "re-sends"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 5},
      {"session": "a", "turn": 0, "input_tokens": 20, "output_tokens": 1}], "t.jsonl:2.turn", "turn 1"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 5, "arrival_s": -1}],
     "t.jsonl:1.arrival_s", ">= 0"),
    ([{"session": "a", "turn": 0, "input_tokens": 10, "output_tokens": 5, "arrival_s": 2},
      {"session": "a", "turn": 1, "input_tokens": 20, "output_tokens": 1, "arrival_s": 1}],
     "t.jsonl:2.arrival_s", "earlier"),
    ([{"session": "a", "turn": 0, "input_tokens": 1, "output_tokens": 5}], "t.jsonl:1.input_tokens",
     "session tag"),
    ([""], "t.jsonl", "no records"),
])
def test_trace_errors_name_line_and_key(tmp_path, lines, where, match):
    path = write_trace(tmp_path, lines)
    with pytest.raises(InputError, match=match) as e:
        load_trace(path)
    assert e.value.where.endswith(where)


def test_missing_trace_file(tmp_path):
    with pytest.raises(InputError, match="no trace file"):
        load_trace(str(tmp_path / "none.jsonl"))


def test_a_concurrency_past_the_sessions_opens_them_at_once():
    """``start`` opens sessions until the workload has no more (its count, or the run's end): a
    concurrency far above the sessions does not loop over the slots left (it hung at 2**31)."""
    from sim.engine.workload import MAX_CONCURRENCY

    d = WorkloadDriver(Workload(small(concurrency=MAX_CONCURRENCY, sessions=4), seed=0))
    assert len(d.start(0)) == 4 and d.sessions_started == 4


def test_sizes_past_any_deployment_are_refused_naming_the_key():
    from sim.engine.workload import MAX_CONCURRENCY, MAX_CONTEXT_TOKENS, MAX_SESSION_TURNS

    for kw, key in ((dict(concurrency=MAX_CONCURRENCY + 1), "concurrency"),
                    (dict(max_context_tokens=MAX_CONTEXT_TOKENS + 1), "max_context_tokens"),
                    # turns of 2 tokens filling 2M tokens: a million turns a session, planned up front
                    (dict(user_tokens_min=1, output_tokens_min=1, output_tokens_max=1,
                          max_context_tokens=MAX_CONTEXT_TOKENS), "max_turns")):
        with pytest.raises(InputError, match=f"workload.{key}"):
            small(**kw)
    # the turns bounded by max_turns instead: accepted
    small(user_tokens_min=1, output_tokens_min=1, output_tokens_max=1, max_context_tokens=MAX_CONTEXT_TOKENS,
          max_turns=MAX_SESSION_TURNS)
