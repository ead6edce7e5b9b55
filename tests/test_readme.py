"""The README's Python examples run as written."""
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("k", range(len(_blocks())))
def test_readme_python_block_runs(k, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    namespace: dict = {}
    exec(compile(_blocks()[k], f"README.md python block {k}", "exec"), namespace)


def test_readme_host_program_records_a_schedule_that_reruns_the_same():
    from sim.snapshot import snapshot_of

    block = next(b for b in _blocks() if "run_programs" in b)
    ns: dict = {}
    exec(compile(block, "README.md host program", "exec"), ns)
    rerun = ns["run_schedule"](ns["validate"](ns["run"].recorded), ns["load_profile"]("h200"))
    a, b = snapshot_of(ns["run"]), snapshot_of(rerun)
    assert a.buffers == b.buffers and a.timings_us == b.timings_us
    assert all((a.reads[k] == b.reads[k]).all() for k in a.reads)
    assert [d["op"] for d in ns["run"].recorded["ops"]].count("host_query") >= 2   # it polled
