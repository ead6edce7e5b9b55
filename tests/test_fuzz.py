"""Bad input never gives a traceback, a hang or a blow-up (tests/fuzz.py).

Each mutant of ``examples/*.json`` is built in a worker process from its seed and
goes through ``kvrace schedule validate`` and ``kvrace schedule run --json``
in-process, in a worker limited to 2 GiB of address space above its size after
imports, with 20 s per input (building included), one worker per CPU: exit codes
0/1/2 only, no exception escaping ``main``, and ``validate`` accepting only what
``run`` runs.  The default tier runs seeds 0..299 (about 45 s on 2 cores), the
slow tier seeds 300..10,299.
"""
import json
import os

import pytest

from tests.fuzz import EXAMPLES, Harness, build, failing, mutant, mutant_path, run_seeds

DEFAULT_INPUTS = 300
SLOW_INPUTS = 10_000


def _report(outcomes) -> str:
    bad = failing(outcomes)
    return "\n".join(f"seed {o.seed} ({', '.join(o.kinds)}): {o.failure}; reproduce with "
                     f"python benchmarks/fuzz_inputs.py --seed {o.seed} --one; input {o.input_path}\n"
                     f"{o.detail[-1500:]}" for o in bad[:5])


def test_mutants_are_deterministic_and_varied():
    assert mutant(7) == mutant(7) and build(7) == build(7)
    outs = {mutant(s) for s in range(40)}
    assert len(outs) == 40
    originals = {p.read_bytes() for p in EXAMPLES}
    assert not outs & originals
    kinds = {k.split(":")[0] for s in range(300) for k in build(s)[1]}
    assert {"base", "delete", "swap", "number", "nest", "many", "big", "text"} <= kinds


def test_harness_reports_each_kind_of_failure(tmp_path):
    """The checks can fail: a traceback, a timeout and an over-budget allocation are
    caught; RSS is measured per input; a failing seed's input file is kept."""
    import sim.schedule as sched
    import tests.fuzz as fuzz

    real_check = fuzz._check_one
    with Harness(time_budget=20, mem_budget=1 << 30, in_dir=str(tmp_path)) as h:
        ok = h.check_path(str(EXAMPLES[0]))
        assert ok.failure is None and ok.validate_rc == 0 and ok.run_rc in (0, 1)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"kvrace_schedule": 1, "name": "big"}))
        real = sched.validate
        try:                       # the worker forks from here: patch before it starts
            h.close()
            sched.validate = lambda doc, **kw: (_ for _ in ()).throw(KeyError("boom"))
            out = h.check_path(str(bad))
            assert out.failure == "validate: traceback" and "KeyError" in out.detail
            h.close()
            sched.validate = lambda doc, **kw: bytearray(2 << 30)
            out = h.check_path(str(bad))
            assert out.failure == "validate: traceback" and out.memory_error
            h.close()

            # 300 MiB touched by one input shows in its peak; the next input's peak is its own
            def fat(doc, **kw):
                if isinstance(doc, dict) and doc.get("name") == "big":
                    blob = b"x" * (300 << 20)
                    assert len(blob)
                return real(doc, **kw)
            sched.validate = fat
            big = h.check_path(str(bad))
            small = h.check_path(str(EXAMPLES[0]))
            assert big.failure is None and small.failure is None and big.rss_exact and small.rss_exact
            assert big.rss_growth_bytes >= 280 << 20
            assert small.peak_rss_bytes < big.peak_rss_bytes - (200 << 20)
            h.close()

            sched.validate = lambda doc, **kw: __import__("time").sleep(60)
            h.time_budget = 1
            out = h.check_path(str(bad))
            assert out.timed_out and out.failure == "over 1 s"
            h.close()
            fuzz._check_one = lambda path, out: __import__("time").sleep(60)
            out = h.check(5)                       # a seed: built in the worker, its file kept
            assert out.timed_out and out.input_path == mutant_path(str(tmp_path), 5)
            assert open(out.input_path, "rb").read() == mutant(5) and out.kinds == build(5)[1]
        finally:
            sched.validate = real
            fuzz._check_one = real_check
            h.close()


def _run(seeds):
    outcomes = run_seeds(seeds)
    assert len(outcomes) == len(seeds)
    assert not failing(outcomes), _report(outcomes)
    assert all(o.validate_rc in (0, 2) for o in outcomes)
    return outcomes


def test_fuzzed_examples_default(tmp_path):
    outcomes = _run(range(DEFAULT_INPUTS))
    # the corpus reaches both verdicts: some mutants stay valid and run, some are refused
    assert any(o.verdict == "ran" for o in outcomes) and any(o.verdict == "refused" for o in outcomes)
    # each mutant is cheap to build (generous bound: the machine may be busy)
    assert max(o.build_seconds for o in outcomes) < 2.0
    assert all(o.kinds and o.peak_rss_bytes > 0 for o in outcomes)


@pytest.mark.slow
def test_fuzzed_examples_slow():
    _run(range(DEFAULT_INPUTS, DEFAULT_INPUTS + SLOW_INPUTS))


def test_passing_inputs_leave_no_files(tmp_path):
    outs = run_seeds(range(4), jobs=2, in_dir=str(tmp_path))
    assert [o.seed for o in outs] == [0, 1, 2, 3] and not failing(outs)
    assert os.listdir(tmp_path) == []
