"""Bad input never gives a traceback, a hang or a blow-up (tests/fuzz.py).

Each mutant of ``examples/*.json`` goes through ``kvrace schedule validate`` and
``kvrace schedule run --json`` in-process, in a worker limited to 2 GiB of address
space above its size after imports, with 20 s per input: exit codes 0/1/2 only,
no exception escaping ``main``, and ``validate`` accepting only what ``run`` runs.
"""
import json

import pytest

from tests.fuzz import EXAMPLES, Harness, failing, mutant

DEFAULT_INPUTS = 200
SLOW_INPUTS = 10_000


def _report(outcomes) -> str:
    bad = failing(outcomes)
    return "\n".join(f"seed {o.seed}: {o.failure}\n{o.detail[-1500:]}" for o in bad[:5])


def test_mutants_are_deterministic_and_varied():
    assert mutant(7) == mutant(7)
    outs = {mutant(s) for s in range(40)}
    assert len(outs) == 40
    originals = {p.read_bytes() for p in EXAMPLES}
    assert not outs & originals


def test_harness_reports_each_kind_of_failure(tmp_path):
    """The checks can fail: a traceback, a timeout and an over-budget allocation are caught."""
    import sim.schedule as sched

    with Harness(time_budget=20, mem_budget=1 << 30) as h:
        ok = h.check_path(str(EXAMPLES[0]))
        assert ok.failure is None and ok.validate_rc == 0 and ok.run_rc in (0, 1)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"kvrace_schedule": 1}))
        real = sched.validate
        try:                       # the worker forks from here: patch before it starts
            h.close()
            sched.validate = lambda doc: (_ for _ in ()).throw(KeyError("boom"))
            out = h.check_path(str(bad))
            assert out.failure == "validate: traceback" and "KeyError" in out.detail
            h.close()
            sched.validate = lambda doc: bytearray(2 << 30)
            out = h.check_path(str(bad))
            assert out.failure == "validate: traceback" and out.memory_error
            h.close()
            sched.validate = lambda doc: __import__("time").sleep(60)
            h.time_budget = 1
            out = h.check_path(str(bad))
            assert out.timed_out and out.failure == "over 1 s"
        finally:
            sched.validate = real
            h.close()


def _run(seeds):
    with Harness() as h:
        outcomes = [h.check(s) for s in seeds]
    assert not failing(outcomes), _report(outcomes)
    assert all(o.validate_rc in (0, 2) for o in outcomes)
    return outcomes


def test_fuzzed_examples_default():
    outcomes = _run(range(DEFAULT_INPUTS))
    # the corpus reaches both verdicts: some mutants stay valid and run, some are refused
    assert any(o.validate_rc == 0 for o in outcomes) and any(o.validate_rc == 2 for o in outcomes)


@pytest.mark.slow
def test_fuzzed_examples_slow():
    _run(range(DEFAULT_INPUTS, DEFAULT_INPUTS + SLOW_INPUTS))
