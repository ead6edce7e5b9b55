"""The online verdicts' read hook (``OnlineVerdicts.on_read``) and the fast paths of
the online verdicts, each checked against the path it replaces."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.executor import Executor, _static_program
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile
from tests.strategies import rich_schedules, schedules

P = profile(jitter_frac=0.1)
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(s, seed: int, hook=None):
    """run_schedule(s, keep="report"), with ``hook`` given to the verdicts before the run."""
    by_host: dict = {h: [] for h in s.hosts}
    for op in s.ops:
        by_host[op.host].append(op)
    ex = Executor(s.buffers, s.streams, P, keep="report", hosts=s.hosts, static_ops=s.ops, seed=seed)
    if hook is not None:
        ex.online.on_read(hook)
    several = sum(1 for ops in by_host.values() if ops) > 1
    return ex.run({h: _static_program(ops, several) for h, ops in by_host.items()}, s)


@SETTINGS
@given(st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14)), st.integers(0, 3))
def test_on_read_sees_every_entry_the_report_keeps_and_keeps_none(doc, seed):
    s = validate(doc)
    kept = analyse(_run(s, seed))
    seen = []
    run = _run(s, seed, lambda cap, views, entry: seen.append((cap, views, entry)))
    hooked = analyse(run)
    assert [e for _, _, e in seen] == kept["reads"]
    assert run.online.reads == [] and hooked["reads"] == [] and not run.online._expected
    for cap, views, entry in seen:
        assert cap.op_id == entry["op"] and len(views) == len(cap.views)
        assert [v.offset for v in views] == [v.offset for v in cap.views]
    # everything but the reads is the same report
    for key in ("schedule_digest", "latent_races", "latent_races_total", "intra_launch_races", "end_us"):
        assert hooked[key] == kept[key], key


def test_on_read_refuses_a_non_callable_and_can_be_unset():
    doc = {"kvrace_schedule": 2, "name": "one", "buffers": [
        {"name": "d", "location": "host", "kind": "kv",
         "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": 4, "unit_bytes": 64}}],
        "streams": [{"name": "s", "device": 0}], "events": [],
        "ops": [{"id": "r", "op": "read", "stream": "s", "buffer": "d", "layer": 0, "units": [1]}]}
    s = validate(doc)
    ex = Executor(s.buffers, s.streams, P, keep="report", hosts=s.hosts, static_ops=s.ops)
    with pytest.raises(InputError, match="callback"):
        ex.online.on_read(3)
    ex.online.on_read(print)
    ex.online.on_read(None)
    run = ex.run({"host": _static_program(s.ops, False)}, s)
    assert [r["op"] for r in run.online.reads] == ["r"]
