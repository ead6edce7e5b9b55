"""The public API: one error root (``KvraceError``), ``sim.__all__``, a light ``import sim``, the
import direction (``sim`` never imports ``gpu_backend`` or the ``kvrace`` command line) and the
shared key check."""
from __future__ import annotations

import ast
import importlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import sim
from sim.errors import InputError, KvraceError, check_keys
from tests.helpers import schedule_doc

ROOT = Path(__file__).resolve().parent.parent


# ---- one error root ----

def _error_classes():
    from gpu_backend.calibrate import NotStaged
    from gpu_backend.providers.base import ProviderError
    from gpu_backend.runner import UnsupportedOp
    from gpu_backend.sglang_shim import ShimError
    from sim.replay import ReplayError

    # class -> the builtin base it keeps, so existing `except ValueError:` and the like still match
    return {InputError: ValueError, ReplayError: Exception, ProviderError: RuntimeError,
            UnsupportedOp: RuntimeError, ShimError: ImportError, NotStaged: RuntimeError}


def test_every_kvrace_error_derives_from_one_root():
    for cls, builtin in _error_classes().items():
        assert issubclass(cls, KvraceError), cls
        assert issubclass(cls, builtin), cls
        e = cls("w", "m") if cls is InputError else cls("it failed")
        with pytest.raises(KvraceError):          # one type catches them all
            raise e


def test_every_exception_class_in_gpu_backend_is_a_kvrace_error():
    """Any exception class defined under gpu_backend/ (found in the source) derives from KvraceError."""
    found = []
    for path in sorted((ROOT / "gpu_backend").rglob("*.py")):
        tree = ast.parse(path.read_text())
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Staged", "Op")):
                cls = getattr(importlib.import_module(mod), node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append(cls)
                    assert issubclass(cls, KvraceError), f"{mod}.{node.name}"
    assert len(found) >= 4


def test_a_real_input_error_is_caught_as_kvrace_error():
    rd = {"op": "read", "stream": "s0", "buffer": "nope", "layer": 0, "units": [0]}
    with pytest.raises(KvraceError) as info:
        sim.validate(schedule_doc([rd]))
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)
    assert "ops[0]" in str(info.value)


def test_a_real_provider_error_is_caught_as_kvrace_error():
    from gpu_backend.providers import get_provider

    with pytest.raises(KvraceError, match="nope"):
        get_provider("nope")


def test_input_error_keeps_its_signature_pickling_and_args():
    e = InputError("ops[3].args.src_indices", "expected a list")
    assert e.where == "ops[3].args.src_indices" and e.message == "expected a list"
    assert str(e) == "ops[3].args.src_indices: expected a list"
    assert e.args == ("ops[3].args.src_indices", "expected a list")
    for again in (pickle.loads(pickle.dumps(e)), type(e)(*e.args)):
        assert type(again) is InputError and again.args == e.args and str(again) == str(e)
    bare = InputError("just a message")
    assert bare.where == "" and str(bare) == "just a message"
    assert str(pickle.loads(pickle.dumps(bare))) == "just a message"


# ---- sim.__all__ ----

PUBLIC = {"load": "sim.schedule", "validate": "sim.schedule", "Schedule": "sim.schedule",
          "ScheduleBuilder": "sim.schedule", "run_schedule": "sim.executor", "run_programs": "sim.executor",
          "run_reference": "sim.executor", "Host": "sim.executor", "TieBreak": "sim.executor",
          "RunResult": "sim.executor", "analyse": "sim.verdicts", "summary_text": "sim.verdicts",
          "Snapshot": "sim.snapshot", "snapshot_of": "sim.snapshot", "load_profile": "sim.profile",
          "Profile": "sim.profile", "KvraceError": "sim.errors", "InputError": "sim.errors",
          "ReplayError": "sim.replay", "cut_window": "sim.window", "CacheSession": "sim.cache.session",
          "SessionConfig": "sim.cache.session", "HiRadixCache": "sim.cache.hiradix",
          "HiCacheController": "sim.cache.controller",
          "load_scenario": "sim.engine.scenario", "PrefillEngine": "sim.engine.engine",
          "run_prefill_engine": "sim.engine.engine", "EngineResult": "sim.engine.engine",
          "run_signatures": "sim.engine.signatures", "Explorer": "sim.explore"}


def test_all_is_the_curated_api_and_each_name_is_its_modules_object():
    assert set(sim.__all__) == set(PUBLIC)
    for name, home in PUBLIC.items():
        assert getattr(sim, name) is getattr(importlib.import_module(home), name), name
    ns: dict = {}
    exec("from sim import *", ns)
    assert set(PUBLIC) <= set(ns)
    assert set(PUBLIC) <= set(dir(sim))
    with pytest.raises(AttributeError):
        sim.no_such_name  # noqa: B018


def test_the_api_runs_an_example_end_to_end():
    s = sim.load(str(ROOT / "examples" / "index_k_ungated_race.json"))
    run = sim.run_schedule(s, sim.load_profile("h200"), ties=sim.TieBreak("fifo"))
    rep = sim.analyse(run)
    assert rep["corrupt_reads"] == 1 and "STALE" in sim.summary_text(rep)
    assert isinstance(sim.snapshot_of(run), sim.Snapshot)


def test_import_sim_is_light():
    """``import sim`` and every public name load numpy, simpy and networkx only: never torch,
    gpu_backend or the kvrace command line."""
    code = ("import sys, json, sim\n"
            "for n in sim.__all__: getattr(sim, n)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr
    top = set(json.loads(p.stdout))
    assert not top & {"torch", "gpu_backend", "kvrace", "cuda", "matplotlib"}
    third_party = {m for m in top - set(sys.stdlib_module_names) if not m.startswith("_")}
    assert third_party <= {"sim", "numpy", "simpy", "networkx", "tomli"}, third_party


# ---- import direction ----

def _imports(path: Path) -> list[str]:
    """Modules a file imports: import statements, and string arguments of import_module / __import__."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                out.append(str(node.args[0].value))
    return out


def test_sim_never_imports_gpu_backend_or_the_cli():
    files = sorted((ROOT / "sim").rglob("*.py"))
    assert len(files) > 10 and not (ROOT / "sim" / "cli.py").exists()
    bad = [(str(f.relative_to(ROOT)), m) for f in files for m in _imports(f)
           if m.split(".")[0] in ("gpu_backend", "kvrace") or m == "sim.cli"]
    assert bad == []


def test_gpu_backend_never_imports_the_cli():
    bad = [(str(f.relative_to(ROOT)), m) for f in sorted((ROOT / "gpu_backend").rglob("*.py"))
           for m in _imports(f) if m.split(".")[0] == "kvrace" or m.startswith("sim.cli")]
    assert bad == []


def test_console_script_points_at_kvrace_cli():
    from sim.profile import tomllib
    from kvrace.cli import main

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["scripts"]["kvrace"] == "kvrace.cli:main"
    assert "kvrace*" in doc["tool"]["setuptools"]["packages"]["find"]["include"]
    assert callable(main)


# ---- the shared key check ----

def test_check_keys_names_the_first_unknown_key_then_the_first_missing_one():
    with pytest.raises(InputError) as info:
        check_keys({"a": 1, "zz": 2, "yy": 3}, ("a", "b"), "x", ("a",))
    assert info.value.where == "x.zz" and "expected one of ['a', 'b']" in info.value.message
    assert "unknown key 'zz'" in info.value.message
    with pytest.raises(InputError) as info:
        check_keys({"a": 1}, ("a", "b"), "x", ("a", "b"), context=" for r", missing="argument")
    assert info.value.where == "x.b" and info.value.message == "expected this argument for r, got nothing (missing)"
    check_keys({"a": 1}, {"b", "a"}, "x", ("a",))          # sets are accepted (listed sorted)


def test_check_keys_truncates_a_huge_key():
    key = "k" * 10_000
    with pytest.raises(InputError) as info:
        check_keys({key: 1}, ("a",), "x")
    assert len(str(info.value)) < 400 and info.value.where.startswith("x.kkk") and info.value.where.endswith(" chars)")
    with pytest.raises(InputError) as info:
        check_keys({"it's": 1}, ("a",), "x")
    assert info.value.where == "x.it's"


def test_layouts_and_routines_use_the_shared_check():
    from sim.pools.layouts import layout_from_json
    from sim.transfers import routines

    assert not hasattr(routines, "_check_keys")
    huge = "q" * 5000
    with pytest.raises(InputError) as info:
        layout_from_json({"preset": "dsa_index_k", huge: 1}, "buffers[0].layout")
    assert len(str(info.value)) < 400 and info.value.where.endswith("(5002 chars)")
    s = json.loads((ROOT / "examples" / "index_k_gated.json").read_text())
    copy = next(op for op in s["ops"] if op["op"] == "copy")
    copy["args"][huge] = 1
    with pytest.raises(InputError) as info:
        sim.validate(s)
    assert len(str(info.value)) < 400 and ".args." in info.value.where


# ---- schedule selections ----

def test_tokens_read_on_a_host_buffer_is_an_input_error():
    rd = {"op": "read", "stream": "s0", "buffer": "H", "layer": 0, "tokens": [0]}
    with pytest.raises(InputError) as info:
        sim.validate(schedule_doc([rd]))
    assert info.value.where == "ops[0] (op0).tokens"
    assert "device (paged) layout" in info.value.message
