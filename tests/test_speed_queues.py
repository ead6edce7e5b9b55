"""The executor's stream queue and link queue (``StreamQueue``, ``LinkResource``) schedule
the same events in the same order as the ``simpy.Store`` and ``simpy.Resource`` they
replace: random producer/consumer scripts give the same log and the same number of
scheduled events, and random schedules give the same run and report with either."""
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.executor import Executor, LinkResource, StreamQueue, TieBreak, run_schedule
from sim.schedule import validate
from sim.verdicts import analyse
from tests.helpers import profile
from tests.strategies import rich_schedules, schedules

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCRIPT_SETTINGS = settings(max_examples=150, deadline=None)

# a script: per actor, a list of (delay before the step, what it does)
steps = st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 2]), st.sampled_from(["put", "get", "hold"])),
                 min_size=1, max_size=8)
scripts = st.lists(steps, min_size=1, max_size=4)


def _queue_log(make, script):
    env = simpy.Environment()
    q = make(env)
    log = []

    def actor(a, plan):
        for k, (delay, what) in enumerate(plan):
            if delay:
                yield env.timeout(delay)
            if what == "put":
                q.put((a, k))
                log.append((env.now, a, "put", k))
                yield env.timeout(0)           # an event scheduled between the put and its processing
                log.append((env.now, a, "after put", k))
            elif what == "get":
                ev = q.get()
                log.append((env.now, a, "asked", ev.triggered))
                item = yield ev
                log.append((env.now, a, "got", item))
            else:
                yield env.timeout(0)
                log.append((env.now, a, "hold", k))

    for a, plan in enumerate(script):
        env.process(actor(a, plan))
    env.run(until=100)
    return log, [x for x in q.items], next(env._eid)


@SCRIPT_SETTINGS
@given(scripts)
def test_stream_queue_schedules_what_simpy_store_does(script):
    assert _queue_log(StreamQueue, script) == _queue_log(simpy.Store, script)


def _link_log(make, script):
    env = simpy.Environment()
    link = make(env, capacity=1)
    log = []

    def actor(a, plan):
        for k, (delay, what) in enumerate(plan):
            if delay:
                yield env.timeout(delay)
            req = link.request()
            log.append((env.now, a, "asked", k, req.triggered))
            yield req
            log.append((env.now, a, "granted", k))
            yield env.timeout({"put": 0, "get": 1, "hold": 3}[what])
            link.release(req)
            log.append((env.now, a, "released", k))
            yield env.timeout(0)               # an event scheduled between the release and its processing
            log.append((env.now, a, "after release", k))

    for a, plan in enumerate(script):
        env.process(actor(a, plan))
    env.run(until=200)
    return log, len(link.users), next(env._eid)


@SCRIPT_SETTINGS
@given(scripts)
def test_link_resource_schedules_what_simpy_resource_does(script):
    assert _link_log(LinkResource, script) == _link_log(simpy.Resource, script)


P = profile(jitter_frac=0.1)
any_schedule = st.one_of(rich_schedules(max_ops=14), schedules(max_ops=14))


@SETTINGS
@given(any_schedule, st.integers(0, 3), st.sampled_from(["fifo", "seeded"]))
def test_runs_with_simpy_queues_equal_runs_with_light_queues(doc, seed, ties):
    """The whole run (timings, tie orders, item landing times, reads, report) with
    ``simpy.Store``/``simpy.Resource`` as the stream and link queues equals the run with
    ``StreamQueue``/``LinkResource``."""
    def go():
        run = run_schedule(validate(doc), P, seed=seed, ties=TieBreak(ties, seed=seed))
        return run, analyse(run)

    fast, fast_rep = go()
    mp = __import__("pytest").MonkeyPatch()
    try:
        mp.setattr(Executor, "queue_type", simpy.Store)
        mp.setattr(Executor, "link_type", simpy.Resource)
        slow, slow_rep = go()
    finally:
        mp.undo()
    assert fast.timings == slow.timings and fast.tie_orders == slow.tie_orders
    assert {k: v.tolist() for k, v in fast.item_end_us.items()} == {k: v.tolist() for k, v in slow.item_end_us.items()}
    assert fast.access_seq == slow.access_seq
    assert fast_rep == slow_rep
