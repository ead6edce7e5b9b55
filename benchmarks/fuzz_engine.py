"""Fuzz ``kvrace run`` with random scenarios and overrides nobody tried (issue 9 robustness).

Each case is a shipped preset (or a scenario TOML file written for the case, sometimes
malformed) with small-run overrides (``run.layers`` 1-4, short ``run.duration_s``, few
sessions and turns, small contexts and pools) and random overrides of every scenario key
(``docs/scenarios.md``): valid values, boundary values and invalid ones (wrong types, out of
range, unknown keys and sections, impossible combinations, malformed trace files).  Every case
runs through the CLI, ``python -m kvrace run FILE|PRESET --set ... --json -``, in a child
process with a timeout, and is classified:

* ``OK``: exit 0 and JSON with issue 9's keys whose invariants hold (:func:`invariants`);
* ``INPUT``: exit != 0 and stderr exactly one line ``kvrace: error: <key>: expected ...``
  naming a key, no traceback;
* ``BUG``: a traceback, a timeout, an error naming no key, a broken invariant, or a result
  for an input the fuzzer knows must be refused (an override drawn as invalid).

``--export`` also reruns every OK case with ``--export-races D --export-limit 2`` (the whole
run kept, ``keep="all"``, a byte-level decode side's included): its JSON must equal the streamed
run's, wall time and the export's keys aside, and every exported window (``race_*.json``,
``decode_race_*.json``) must rerun under ``kvrace schedule run``'s default profile with its read
stale or torn (:func:`export_violations`); else the case is a ``BUG``.

``--boundaries`` runs, instead of drawn cases, every numeric scenario key at its lower bound and at
huge values (:func:`boundary_cases`: three values a key on two presets), where the drawn cases'
values stay near the presets' (sixteen of them were bugs until the sizes were bounded).

Usage::

    python benchmarks/fuzz_engine.py --cases 300 --seed 0 --jobs 2 --timeout 60 \
        --bugs /tmp/fuzz_bugs.json

prints a table (cases per class, per preset) and writes the bugs (preset, overrides, symptom,
the last lines of stderr) as JSON.  ``draw_case(rng)`` / ``run_case(case)`` / ``classify``
are the pieces ``tests/test_engine_fuzz.py`` uses.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sim.engine.hypotheses import hypothesis_names  # noqa: E402
from sim.engine.scenario import SCHEDULE_POLICIES  # noqa: E402
from sim.profile import shipped_profiles  # noqa: E402

__all__ = ["Case", "Outcome", "draw_case", "draw_stress_case", "boundary_cases", "run_case", "classify", "invariants",
           "main"]

PRESETS = ("incident", "incident-short", "incident-repro", "glm5-22811", "glm5-22811-small")
PAGE = {"deepseek-v4-flash": 256, "dsa-v3.2": 64}
PRESET_FAMILY = {"incident": "deepseek-v4-flash", "incident-short": "deepseek-v4-flash",
                 "incident-repro": "deepseek-v4-flash", "glm5-22811": "dsa-v3.2", "glm5-22811-small": "dsa-v3.2"}
GATE_MAPS = ("incident-fork", "upstream-0.5.10", "upstream-0.5.11")
HYPOTHESES = tuple(hypothesis_names())     # every shipped switch (sorted: draws stay seeded)
PROFILES = tuple(shipped_profiles())
RUN_KEYS = ("scenario", "seed", "requests_total", "requests_corrupted", "corrupted_fraction", "stale_reads",
            "torn_reads", "latent_races", "oob_writes", "load_backs", "branches", "sim_time_s", "wall_time_s")
_ERROR_LINE = re.compile(r"^kvrace: error: (\S+): (.+)$")


@dataclass
class Case:
    """One ``kvrace run``: ``target`` is a preset name or a file written from ``file_text``;
    ``invalid`` lists the overridden keys drawn with a value that must be refused."""

    index: int
    preset: str
    overrides: list[str]
    invalid: list[str] = field(default_factory=list)
    file_text: str | None = None
    trace_text: str | None = None
    seed_arg: int | None = None
    profile_text: str | None = None   # a profile TOML written for the case (launch jitter)
    evict: bool = False               # an --evict case: OK runs expected clean are checked (expected_clean)


@dataclass
class Outcome:
    case: Case
    klass: str              # OK | INPUT | BUG
    symptom: str
    rc: int | None
    wall_s: float
    stderr_tail: str = ""
    features: tuple = ()    # OK runs: what they exercised (load-backs, ranks, decode side, aborts, corruption)
    result: dict = field(default_factory=dict)  # OK runs: the result's scalar keys (and decode's)


# ------------------------------------------------------------------ drawing cases

def _small(rng: random.Random, family: str) -> dict[str, str]:
    """Overrides that keep a run to seconds: few layers, sessions, turns, small contexts and pools."""
    ps = PAGE[family]
    o = {
        # NOTE: DeepSeek V4 needs its first C4 layer (layer 2): 3 layers at least
        "run.layers": rng.choice([1, 2, 2, 3, 4] if family == "dsa-v3.2" else [3, 3, 4]),
        "run.duration_s": rng.choice([0.05, 0.2, 0.5, 1.0]),
        "workload.sessions": rng.choice([1, 2, 3, 4, 6]),
        "workload.concurrency": rng.choice([1, 2, 3, 4]),
        "workload.max_turns": rng.choice([1, 2, 3, 4]),
        "workload.system_prompt_tokens": rng.choice([0, 16, 64]),
        "workload.first_turn_tokens": rng.choice([128, 300, 512]),
        "workload.user_tokens_min": 32,
        "workload.user_tokens_max": rng.choice([64, 200]),
        "workload.output_tokens_min": rng.choice([1, 4]),
        "workload.output_tokens_max": rng.choice([4, 16]),
        "workload.max_context_tokens": rng.choice([1024, 2048]),
        "workload.think_time_s": rng.choice([0, 0.01]),
        # pools a few contexts overflow, so that prefixes are evicted to the host and loaded back
        "scheduler.max_total_tokens": ps * (rng.choice([10, 12, 16, 32]) if ps == 64 else rng.choice([4, 6, 8])),
        "scheduler.chunked_prefill_size": rng.choice([-1, ps, 2 * ps, 4 * ps]),
    }
    return {k: str(v) for k, v in o.items()}


def _mutations(rng: random.Random, family: str, tmp: str) -> list[tuple[str, str, bool]]:
    """(key, value text, must be refused) for every scenario key: valid, boundary and invalid values."""
    ps = PAGE[family]
    hyps = ",".join(rng.sample(HYPOTHESES, rng.randint(0, 3)))
    bad_gate = os.path.join(tmp, "bad_gate.toml")
    return [
        ("model.family", rng.choice(list(PAGE)), False), ("model.family", "llama", True),
        ("model.index_k_dtype", rng.choice(["fp8", "bf16"]), False), ("model.index_k_dtype", "int4", True),
        ("model.index_k_store", rng.choice(["fused", "fallback"]), False), ("model.index_k_store", "7", True),
        ("model.indexer_path", rng.choice(["cuda", "cuda_cp", "other"]), False),
        ("model.indexer_path", "", True),
        ("variant.gate_map", rng.choice(GATE_MAPS), False), ("variant.gate_map", "nomap", True),
        ("variant.gate_map", bad_gate, True),
        ("variant.hypotheses", hyps, False), ("variant.hypotheses", "none,bogus", True),
        ("deployment.mode", rng.choice(["pd", "colocated"]), False), ("deployment.mode", "both", True),
        ("deployment.gpus", rng.choice(["1", "2", "4", "8", "16"]), False), ("deployment.gpus", "0", True),
        ("deployment.gpus", "eight", True),
        ("deployment.prefill_tp", rng.choice(["1", "2", "4", "8"]), False), ("deployment.prefill_tp", "0", True),
        ("deployment.decode_tp", rng.choice(["1", "2", "4", "8"]), False), ("deployment.decode_tp", "3", True),
        ("deployment.decode_tp", "-4", True),
        ("deployment.profile", rng.choice(PROFILES), False), ("deployment.profile", "nope", True),
        ("deployment.simulated_ranks", str(rng.randint(1, 4)), False),
        ("deployment.simulated_ranks", "0", True), ("deployment.simulated_ranks", "2.5", True),
        ("hicache.prefill", rng.choice(["true", "false", "on", "0"]), False), ("hicache.prefill", "maybe", True),
        ("hicache.decode", rng.choice(["true", "false", "yes", "off"]), False), ("hicache.decode", "2", True),
        ("deployment.decode_bytes", rng.choice(["true", "false"]), False), ("deployment.decode_bytes", "2", True),
        # (valid in PD only: must_refuse)
        ("deployment.pd_transfer_gbps", rng.choice(["0", "12.5", "50"]), False),
        ("deployment.pd_transfer_gbps", rng.choice(["-1", "inf", "0.001"]), True),
        ("deployment.pd_transfer_latency_us", rng.choice(["-1", "0", "20", "1000", "1e6"]), False),
        ("deployment.pd_transfer_latency_us", rng.choice(["-0.5", "-2", "x", "2e6"]), True),
        ("hicache.page_size", rng.choice([str(ps), "1", "16", str(2 * ps)]), False),
        ("hicache.page_size", "0", True),
        ("hicache.ratio", rng.choice(["1", "1.0", "1.5", "2", "4", "1e1"]), False),
        ("hicache.ratio", rng.choice(["0.5", "nan", "inf", "abc", "-1"]), True),
        ("hicache.size_gb", rng.choice(["0", "1"]), False), ("hicache.size_gb", "-1", True),
        ("hicache.io_backend", rng.choice(["kernel", "direct"]), False), ("hicache.io_backend", "mmap", True),
        ("hicache.layout", rng.choice(["layer_first", "page_first", "page_first_direct"]), False),
        ("hicache.layout", "page_last", True),
        ("hicache.write_policy", rng.choice(["write_through", "write_through_selective", "write_back"]), False),
        ("hicache.write_policy", "write_around", True),
        ("hicache.load_fence", rng.choice(["true", "false"]), False), ("hicache.load_fence", "sometimes", True),
        ("hicache.load_back_threshold", rng.choice(["0", "1", "10", "100000"]), False),
        ("hicache.load_back_threshold", "-1", True),
        ("scheduler.chunked_prefill_size", rng.choice(["-1", str(ps), str(ps + 1), "1_000_000"]), False),
        ("scheduler.chunked_prefill_size", rng.choice(["-2", "x"]), True),
        # (page-relative values: whether they are refused depends on the final family: must_refuse)
        ("scheduler.chunked_prefill_size", str(ps - 1), False),
        ("scheduler.max_running_requests", rng.choice(["1", "2", "128"]), False),
        ("scheduler.max_running_requests", "0", True),
        ("scheduler.max_total_tokens", str(ps * rng.choice([2, 3, 4, 64])), False),
        ("scheduler.max_total_tokens", rng.choice([str(ps), str(2 * ps + 1)]), False),
        ("scheduler.max_total_tokens", "0", True),
        ("scheduler.overlap", rng.choice(["true", "false"]), False), ("scheduler.overlap", "1.5", True),
        ("scheduler.event_loop", rng.choice(["normal", "overlap"]), False), ("scheduler.event_loop", "fast", True),
        ("scheduler.decode_event_loop", rng.choice(["normal", "overlap"]), False),
        ("scheduler.decode_event_loop", "fast", True),
        ("scheduler.schedule_policy", rng.choice(SCHEDULE_POLICIES), False),
        ("scheduler.schedule_policy", rng.choice(["routing-key", "LPM", ""]), True),
        ("scheduler.max_prefill_tokens", rng.choice([str(ps), str(ps + 1), "16384"]), False),
        ("scheduler.max_prefill_tokens", "0", True),
        ("scheduler.schedule_conservativeness", rng.choice(["0.3", "1", "2.5"]), False),
        ("scheduler.schedule_conservativeness", rng.choice(["0", "-1", "nan"]), True),
        ("workload.kind", "synthetic", False), ("workload.kind", "replay", True),
        ("workload.concurrency", rng.choice(["1", "2", "4"]), False), ("workload.concurrency", "0", True),
        ("workload.sessions", rng.choice(["0", "1", "5"]), False), ("workload.sessions", "-1", True),
        ("workload.arrival", rng.choice(["closed", "poisson"]), False), ("workload.arrival", "batch", True),
        # (a slow arrival or a long think time: idle stretches longer than one host delay may last)
        ("workload.arrival_rate_per_s", rng.choice(["0.5", "100", "1e6", "1e-4"]), False),
        ("workload.arrival_rate_per_s", rng.choice(["0", "-1", "inf"]), True),
        ("workload.think_time_s", rng.choice(["0", "0.1", "5", "3000"]), False),
        ("workload.think_time_s", "-0.1", True),
        ("workload.system_prompt_tokens", rng.choice(["0", "1", "128"]), False),
        ("workload.system_prompt_tokens", "-1", True),
        ("workload.first_turn_tokens", rng.choice(["1", "4", "64", "1000"]), False),
        ("workload.first_turn_tokens", "0", True),
        ("workload.max_context_tokens", rng.choice(["1", "64", "600", "100000"]), False),
        ("workload.max_context_tokens", "0", True),
        ("workload.max_turns", rng.choice(["0", "1", "3"]), False), ("workload.max_turns", "-1", True),
        ("workload.user_tokens_min", rng.choice(["1", "100"]), False), ("workload.user_tokens_min", "0", True),
        ("workload.user_tokens_max", rng.choice(["1", "100", "500"]), False),
        ("workload.output_tokens_min", rng.choice(["1", "50"]), False), ("workload.output_tokens_min", "0", True),
        ("workload.output_tokens_max", rng.choice(["1", "50", "300"]), False),
        ("workload.vocab_size", rng.choice(["2", "3", "1000", "129280"]), False),
        ("workload.vocab_size", "1", True),
        ("run.duration_s", rng.choice(["0.001", "0.3", "1e-6"]), False),
        ("run.duration_s", rng.choice(["0", "-1", "nan", "inf"]), True),
        ("run.seed", rng.choice(["0", "1", "123456789"]), False), ("run.seed", "-1", True),
        ("run.one_step", rng.choice(["true", "false"]), False), ("run.one_step", "perhaps", True),
        ("run.layers", str(rng.randint(1, 4)), False), ("run.layers", "1000", True), ("run.layers", "-1", True),
        ("hicache.nokey", "1", True), ("nosection.x", "1", True), ("run", "1", True),
        ("name", rng.choice(["fuzz", "", "a b"]), False), ("description", "fuzzed", False),
    ]


_TRACES = {
    "ok": '{"session": "a", "turn": 0, "input_tokens": 300, "output_tokens": 8}\n'
          '{"session": "a", "turn": 1, "input_tokens": 400, "output_tokens": 8}\n'
          '{"session": 2, "turn": 0, "input_tokens": 500, "output_tokens": 4, "arrival_s": 0.01}\n',
    "json": '{"session": "a", "turn": 0, "input_tokens": 300\n',
    "empty": "\n\n",
    "order": '{"session": "a", "turn": 1, "input_tokens": 300, "output_tokens": 8}\n',
    "shrink": '{"session": "a", "turn": 0, "input_tokens": 300, "output_tokens": 8}\n'
              '{"session": "a", "turn": 1, "input_tokens": 200, "output_tokens": 8}\n',
    "types": '{"session": true, "turn": 0, "input_tokens": 300, "output_tokens": 8}\n',
    "extra": '{"session": "a", "turn": 0, "input_tokens": 300, "output_tokens": 8, "colour": 1}\n',
    "array": '[1, 2]\n',
    "arrival": '{"session": "a", "turn": 0, "input_tokens": 300, "output_tokens": 8, "arrival_s": -1}\n',
    "short": '{"session": "a", "turn": 0, "input_tokens": 1, "output_tokens": 8}\n',
    "huge": '{"session": "a", "turn": 0, "input_tokens": 100000, "output_tokens": 8}\n',
    "binary": "\udcff",
}


def draw_case(rng: random.Random, index: int = 0, tmp: str | None = None) -> Case:
    """A random case (module doc); ``tmp``: the folder for the case's files (a bad gate map)."""
    tmp = tmp or tempfile.gettempdir()
    preset = rng.choice(PRESETS)
    family = PRESET_FAMILY[preset]
    over = _small(rng, family)
    invalid: list[str] = []
    muts = _mutations(rng, family, tmp)
    want_bad = rng.random() < 0.3
    picks = rng.sample(muts, rng.randint(1, 6))
    if not want_bad:
        picks = [m for m in picks if not m[2]]
    elif not any(m[2] for m in picks):
        picks.append(rng.choice([m for m in muts if m[2]]))
    # feature focus: the two new features and the overlap loop, on every model
    if rng.random() < 0.5:
        picks.append(("deployment.simulated_ranks", str(rng.randint(1, 4)), False))
    if rng.random() < 0.4:
        picks.append(("hicache.decode", rng.choice(["true", "false"]), False))
        if rng.random() < 0.7:
            picks += [("model.family", "dsa-v3.2", False), ("hicache.page_size", "64", False),
                      ("deployment.mode", "pd", False), ("variant.gate_map", rng.choice(GATE_MAPS[1:]), False),
                      ("model.index_k_dtype", "fp8", False)]
            family = "dsa-v3.2"
    if rng.random() < 0.3:
        picks += [("scheduler.overlap", "true", False), ("scheduler.event_loop", "overlap", False)]
    if rng.random() < 0.6:          # a consistent deployment (most random ones are refused)
        if rng.random() < 0.6:
            ptp, dtp, gpus = rng.choice([(1, 1, 2), (2, 2, 4), (4, 4, 8), (2, 2, 8), (4, 2, 6), (1, 2, 3)])
            picks += [("deployment.mode", "pd", False)]
        else:
            ptp, gpus = rng.choice([(1, 1), (2, 2), (4, 4), (4, 8), (8, 8), (2, 8)])
            dtp = ptp
            h = rng.choice(["true", "false"])
            picks += [("deployment.mode", "colocated", False), ("hicache.prefill", h, False),
                      ("hicache.decode", h, False)]
        picks += [("deployment.prefill_tp", str(ptp), False), ("deployment.decode_tp", str(dtp), False),
                  ("deployment.gpus", str(gpus), False),
                  ("deployment.simulated_ranks", str(rng.randint(1, ptp)), False)]
    for key, value, bad in picks:
        if key == "model.family" and not bad and value != family:
            family = value
            if family == "deepseek-v4-flash" and over.get("run.layers") in ("1", "2"):
                over["run.layers"] = "3"
            # mostly keep the run consistent with the new family (its forced page, a fitting gate map)
            if rng.random() < 0.85:
                over["hicache.page_size"] = str(PAGE[family])
                over["scheduler.max_total_tokens"] = str(PAGE[family] * rng.choice([8, 16]))
                over["scheduler.chunked_prefill_size"] = rng.choice(["-1", str(PAGE[family] * 4)])
                over["variant.gate_map"] = "incident-fork" if family == "deepseek-v4-flash" else "upstream-0.5.11"
                over["model.index_k_dtype"] = "bf16" if family == "deepseek-v4-flash" else "fp8"
        if key in over:
            del over[key]               # the drawn value replaces the small-run one, in draw order
        over[key] = value
        if bad:
            invalid.append(key)
    if "deployment.simulated_ranks" in over and rng.random() < 0.7:
        r = over["deployment.simulated_ranks"]
        if r.isdigit() and int(r) > 1:                      # room for the ranks most of the time
            over.setdefault("deployment.prefill_tp", "4")
            over.setdefault("deployment.decode_tp", "4")
    # the last value of a key wins: keep only each key's last value (in order) and recompute `invalid`
    items = list(over.items())
    invalid = [k for k in dict.fromkeys(invalid) if any(k == key and _is_bad(k, v, muts) for key, v in items)]
    case = Case(index, preset, [f"{k}={v}" for k, v in items], invalid)
    r = rng.random()
    if r < 0.12:        # a trace replay, sometimes malformed
        kind = rng.choice(list(_TRACES))
        case.trace_text = _TRACES[kind]
        case.overrides += ["workload.kind=trace", "workload.system_prompt_tokens=16"]
        if kind != "ok" and kind != "huge":
            case.invalid.append("workload.trace")
    elif r < 0.2:       # a scenario file: base preset + a table, sometimes malformed
        kind = rng.choice(["ok", "toml", "unknown", "base", "type", "nobase"])
        case.file_text = {
            "ok": f'base = "{preset}"\n[workload]\nsessions = 2\n',
            "toml": f'base = "{preset}"\n[workload\nsessions = 2\n',
            "unknown": f'base = "{preset}"\n[workload]\nsesions = 2\n',
            "base": 'base = "nopreset"\n',
            "type": f'base = "{preset}"\n[hicache]\nratio = "two"\n',
            "nobase": '[run]\nlayers = 2\nduration_s = 0.1\n[workload]\nsessions = 1\nmax_turns = 1\n'
                      'first_turn_tokens = 300\n[scheduler]\nmax_total_tokens = 4096\n',
        }[kind]
        if kind not in ("ok", "nobase"):
            case.invalid.append("<file>")
    elif r < 0.25:
        case.overrides.append(rng.choice(["badformat", "=1", "hicache.ratio"]))
        case.invalid.append("--set")
    if rng.random() < 0.1:
        case.seed_arg = rng.choice([0, 7, 2**31, -1])
        if case.seed_arg < 0:
            case.invalid.append("--seed")
    return case


def draw_stress_case(rng: random.Random, index: int = 0) -> Case:
    """A valid case made to load back: the small presets' workloads (whose pools their contexts
    overflow: glm5-22811-small, incident-repro) with every feature switch drawn (TP ranks in
    lockstep, decode-side HiCache, the overlap loop, write policies, layouts and io backends,
    gate maps, hypotheses, load fence, one-step forwards, HiCache off, load-back threshold)."""
    dsa = rng.random() < 0.6
    preset = "glm5-22811-small" if dsa else "incident-repro"
    o = {"run.layers": str(rng.choice([1, 2, 3]) if dsa else 3), "run.duration_s": str(rng.choice([0.5, 1.0, 2.0])),
         "workload.sessions": str(rng.choice([3, 4, 6])), "workload.concurrency": str(rng.choice([2, 3, 4])),
         "run.seed": str(rng.randint(0, 99))}
    if dsa:
        o["workload.max_turns"] = str(rng.choice([2, 3, 4]))
    else:
        o["workload.sessions"] = str(rng.choice([4, 8]))
        o["workload.max_context_tokens"] = "4096"
    if rng.random() < 0.5:          # PD (decode-side HiCache on DSA only)
        ptp = rng.choice([1, 2, 4])
        o |= {"deployment.mode": "pd", "deployment.prefill_tp": str(ptp), "deployment.decode_tp": str(ptp),
              "deployment.gpus": str(2 * ptp), "hicache.prefill": rng.choice(["true", "true", "false"]),
              "hicache.decode": rng.choice(["true", "false"]) if dsa else "false",
              "deployment.decode_bytes": rng.choice(["true", "false", "false"])}
        if o["hicache.decode"] == "true" or o["deployment.decode_bytes"] == "true":
            o["scheduler.decode_event_loop"] = rng.choice(["normal", "overlap"])
        o["deployment.pd_transfer_latency_us"] = rng.choice(["-1", "-1", "0", "100", "1000"])
    else:
        ptp = rng.choice([1, 2, 4, 8])
        h = rng.choice(["true", "true", "false"])
        o |= {"deployment.mode": "colocated", "deployment.prefill_tp": str(ptp), "deployment.decode_tp": str(ptp),
              "deployment.gpus": str(ptp), "hicache.prefill": h, "hicache.decode": h}
    o["deployment.simulated_ranks"] = str(rng.randint(1, min(ptp, 4)))
    if rng.random() < 0.4:
        o |= {"scheduler.overlap": "true", "scheduler.event_loop": "overlap"}
    o["hicache.write_policy"] = rng.choice(["write_through", "write_through_selective", "write_back"])
    o["hicache.layout"] = rng.choice(["layer_first", "page_first", "page_first_direct"])
    o["hicache.io_backend"] = rng.choice(["kernel", "direct"])
    o["hicache.load_fence"] = rng.choice(["true", "false"])
    o["hicache.load_back_threshold"] = rng.choice(["0", "10", "300"])
    o["hicache.ratio"] = rng.choice(["1", "1.5", "2", "4"])
    o["run.one_step"] = rng.choice(["true", "false"])
    o["scheduler.max_running_requests"] = rng.choice(["1", "2", "128"])
    o["scheduler.chunked_prefill_size"] = rng.choice(["-1", "64", "512", "2048"] if dsa else ["-1", "256", "4096"])
    if dsa:
        o["variant.gate_map"] = rng.choice(["upstream-0.5.10", "upstream-0.5.11"])
        o["model.index_k_store"] = rng.choice(["fused", "fallback"])
        o["model.indexer_path"] = rng.choice(["cuda", "cuda_cp", "other"])
        hyps = ["none", "ungated-index-k", "load-unfenced", "host-freed-during-load", "index-k-not-backed-up",
                "graph-replay-no-waits"]
    else:
        o["model.index_k_dtype"] = rng.choice(["fp8", "bf16"])
        hyps = list(HYPOTHESES)
    o["variant.hypotheses"] = ",".join(rng.sample(hyps, rng.randint(0, 2)))
    case = Case(index, preset, [f"{k}={v}" for k, v in o.items()])
    return case


EVICT_HYPS = ("none", "host-freed-during-load", "load-unfenced", "index-k-not-backed-up", "ungated-index-k",
              "graph-replay-no-waits")


def _jitter_profile(base: str, jitter_us: float) -> str:
    """A shipped profile's TOML with ``device.launch_jitter_us`` set (launch skew between streams)."""
    with open(os.path.join(ROOT, "sim", "profiles", f"{base}.toml")) as f:
        text = f.read()
    text = re.sub(r"(?m)^launch_jitter_us\s*=.*\n", "", text)
    return text.replace("[device]\n", f"[device]\nlaunch_jitter_us = {jitter_us}\n", 1)


#: ``--boundaries``: the presets and small-run overrides each numeric key's extremes run on
BOUNDARY_RUNS = {"glm5-22811-small": ["run.layers=2", "run.duration_s=0.5", "workload.sessions=4",
                                      "workload.concurrency=2"],
                 "incident-repro": ["run.duration_s=0.3", "workload.sessions=4", "workload.concurrency=2"]}


def boundary_cases() -> list[Case]:
    """Every numeric scenario key, one at a time, at its lower bound (an open one: 1e-300) and at
    huge values (integers 2**31 and 2**62; floats 1e12 and 1e300), on each preset of
    ``BOUNDARY_RUNS``: each must run or be refused naming a key, never a traceback or a hang.
    Deterministic, so a run of it is a list of verdicts, not a sample."""
    import dataclasses

    from sim.engine.scenario import SECTIONS

    cases: list[Case] = []
    for name, cls in SECTIONS.items():
        types = cls.field_types()
        for f in dataclasses.fields(cls):
            t, m = types[f.name], f.metadata
            if t not in (int, float):
                continue
            key, lo = f"{name}.{f.name}", m.get("lo")
            if t is int:
                values = [str(0 if lo is None else lo), str(2 ** 31), str(2 ** 62)]
            else:
                values = ["1e-300" if m.get("lo_open") else str(0 if lo is None else lo), "1e12", "1e300"]
            for preset, small in BOUNDARY_RUNS.items():
                for v in values:
                    over = [o for o in small if not o.startswith(key + "=")] + [f"{key}={v}"]
                    cases.append(Case(len(cases), preset, over))
    return cases


def draw_evict_case(rng: random.Random, index: int = 0) -> Case:
    """A valid case made to load back under heavy eviction: a device pool of a few contexts
    (``scheduler.max_total_tokens``), a host pool that keeps what is evicted (``hicache.ratio``
    2-4), sessions of 3-5 turns whose later turns re-send the earlier prefix, more sessions in
    flight than the pool holds, and every switch that touches a load-back: chunked prefill, write
    policies, layouts, io backends, both loops, 1-3 TP ranks with launch jitter (a profile written
    for the case), decode-side HiCache on PD for dsa-v3.2, the load fence, gate maps and the
    hypotheses that act on load-backs (``EVICT_HYPS``)."""
    dsa = rng.random() < 0.7
    preset = "glm5-22811-small" if dsa else "incident-repro"
    ps = PAGE["dsa-v3.2" if dsa else "deepseek-v4-flash"]
    pool = ps * (rng.choice([12, 16, 24, 32]) if dsa else rng.choice([8, 12, 16]))
    o = {"run.layers": str(rng.choice([1, 2, 3]) if dsa else rng.choice([3, 4])),
         "run.duration_s": str(rng.choice([1.0, 2.0])), "run.seed": str(rng.randint(0, 999)),
         "workload.sessions": str(rng.choice([6, 8])), "workload.concurrency": str(rng.choice([4, 6])),
         "workload.max_turns": str(rng.choice([3, 4, 5])), "workload.system_prompt_tokens": str(rng.choice([0, 64, 128])),
         "workload.first_turn_tokens": str(rng.choice([pool // 4, pool // 3, pool // 2])),
         "workload.user_tokens_min": str(rng.choice([16, 64])), "workload.user_tokens_max": str(rng.choice([128, 256])),
         "workload.output_tokens_min": "4", "workload.output_tokens_max": str(rng.choice([16, 64])),
         "workload.think_time_s": rng.choice(["0", "0", "0.001"]),
         # contexts up to the pool (longer ones would be aborted, not evicted)
         "workload.max_context_tokens": str(rng.choice([pool - ps, pool - 2 * ps])),
         "scheduler.max_total_tokens": str(pool),
         "scheduler.chunked_prefill_size": str(rng.choice([ps, 2 * ps, 4 * ps, -1])),
         "scheduler.max_running_requests": rng.choice(["2", "4", "128"]),
         "hicache.ratio": rng.choice(["2", "3", "4"]), "hicache.prefill": "true",
         "hicache.write_policy": rng.choice(["write_through", "write_through_selective", "write_back"]),
         "hicache.layout": rng.choice(["layer_first", "page_first", "page_first_direct"]),
         "hicache.io_backend": rng.choice(["kernel", "direct"]),
         "hicache.load_fence": rng.choice(["true", "true", "false"]),
         "hicache.load_back_threshold": rng.choice(["0", "10"])}
    ptp = rng.choice([1, 2, 4])
    if dsa and rng.random() < 0.5:
        o |= {"deployment.mode": "pd", "deployment.prefill_tp": str(ptp), "deployment.decode_tp": str(ptp),
              "deployment.gpus": str(2 * ptp), "hicache.decode": rng.choice(["true", "true", "false"])}
    elif not dsa and rng.random() < 0.5:
        o |= {"deployment.mode": "pd", "deployment.prefill_tp": str(ptp), "deployment.decode_tp": str(ptp),
              "deployment.gpus": str(2 * ptp), "hicache.decode": "false",
              "deployment.decode_bytes": rng.choice(["true", "false"])}
        if o["deployment.decode_bytes"] == "true":
            o["scheduler.decode_event_loop"] = rng.choice(["normal", "overlap"])
    else:
        o |= {"deployment.mode": "colocated", "deployment.prefill_tp": str(ptp), "deployment.decode_tp": str(ptp),
              "deployment.gpus": str(ptp), "hicache.decode": "true"}
    o["deployment.simulated_ranks"] = str(rng.randint(1, min(ptp, 3)))
    if rng.random() < 0.5:
        o |= {"scheduler.overlap": "true", "scheduler.event_loop": "overlap"}
    if dsa:
        o["variant.gate_map"] = rng.choice(["upstream-0.5.10", "upstream-0.5.11", "upstream-0.5.11"])
        o["model.index_k_store"] = rng.choice(["fused", "fallback"])
    hyp = "none" if rng.random() < 0.4 else rng.choice(EVICT_HYPS[1:] if dsa else EVICT_HYPS[1:3])
    o["variant.hypotheses"] = hyp
    case = Case(index, preset, [f"{k}={v}" for k, v in o.items()], evict=True)
    if rng.random() < 0.5:
        case.profile_text = _jitter_profile("h200", rng.choice([5.0, 15.0, 40.0]))
    return case


def expected_clean(case: Case) -> bool:
    """Whether the case is SGLang 0.5.11+ as shipped: dsa-v3.2 under the upstream-0.5.11 gate
    map, no hypothesis, the load fence on: no corrupted request, stale or torn read, latent race."""
    o = dict(item.partition("=")[::2] for item in case.overrides)
    return (case.preset == "glm5-22811-small" and o.get("model.family", "dsa-v3.2") == "dsa-v3.2"
            and o.get("variant.gate_map") == "upstream-0.5.11" and o.get("variant.hypotheses") in ("none", "")
            and _BOOL.get(o.get("hicache.load_fence", "true"), True))


def clean_violations(d: dict) -> list[str]:
    """What a run expected clean (:func:`expected_clean`) shows that it must not."""
    bad = [f"{k} {d[k]}" for k in ("requests_corrupted", "stale_reads", "torn_reads", "latent_races", "oob_writes")
           if d.get(k)]
    dec = d.get("decode") or {}
    bad += [f"decode.{k} {dec[k]}" for k in ("requests_corrupted", "stale_reads", "torn_reads") if dec.get(k)]
    return bad


def with_ranks(case: Case, ranks: int) -> Case:
    """The case with ``deployment.simulated_ranks`` set to ``ranks`` (all else the same)."""
    over = [o for o in case.overrides if not o.startswith("deployment.simulated_ranks=")]
    return Case(case.index, case.preset, over + [f"deployment.simulated_ranks={ranks}"], list(case.invalid),
                case.file_text, case.trace_text, case.seed_arg, case.profile_text, case.evict)


def rank_agreement(one: Outcome, two: Outcome) -> list[str]:
    """Where a run on 1 simulated rank and the same run on 2 disagree on requests_total or on the
    requests the KV oracle finds reading wrong KV.

    NOTE: they must agree only without launch jitter (``device.launch_jitter_us`` 0, every
    shipped profile): rank 0 of a 2-rank run then keeps the 1-rank run's keyed compute jitter.
    With launch jitter each rank draws its own skew from the run's one sequential generator, so
    rank 0 of the 2-rank run sees other draws.  Where a read races (the upstream-0.5.10 gate
    map's ungated index-K, ``ungated-index-k``, ``load-unfenced``) whether its bytes are wrong
    when read, which is what the oracle judges, depends on those draws.  Even with no race at all
    (seed 12 case 44: ``index-k-not-backed-up`` under upstream-0.5.11 with the fence; no stale or
    torn read, no latent race, 29 load-backs of 17,664 tokens and 29 wrong-KV requests on both
    runs) the sets differ by one request (22 on 1 rank, 23 on 2): the timing (closed-loop
    sessions send their next turn when the last one ends) decides which request is the one that
    loads back the index-K that was never backed up.  ``--evict`` sweeps found
    such pairs (seed 11: cases 20, 28, 156; seed 12: cases 44, 96), all with launch jitter;
    they are reported, not counted as bugs.  Nor are pairs where either run has a stale or torn
    read (:func:`counts_as_bug`): each rank's keyed compute jitter is its own, so a race on rank 1
    resolves by rank 1's timing (seed 7001 case 12: ``load-unfenced`` with the 0.5.10 map, rank
    1's torn index-K read makes request 10 wrong-KV on 2 ranks only)."""
    if one.klass != "OK" or two.klass != "OK":
        return [f"classes {one.klass}/{two.klass}"]
    a, b = one.result, two.result
    bad = []
    if a["requests_total"] != b["requests_total"]:
        bad.append(f"requests_total {a['requests_total']} (1 rank) != {b['requests_total']} (2 ranks)")
    if a["wrong_kv_rids"] != b["wrong_kv_rids"]:
        bad.append(f"wrong-kv requests {a['wrong_kv_rids']} (1 rank) != {b['wrong_kv_rids']} (2 ranks)")
    return bad


def counts_as_bug(one: Outcome, two: Outcome, broken: list[str]) -> bool:
    """A 1- vs 2-rank disagreement is a bug when neither run has launch jitter nor a raced (stale
    or torn) read: then every rank's reads see what happens-before order gives (see
    :func:`rank_agreement`)."""
    raced = any(o.result.get("stale_reads", 0) or o.result.get("torn_reads", 0) for o in (one, two))
    return bool(broken) and one.case.profile_text is None and not raced


def _is_bad(key: str, value: str, muts) -> bool:
    return any(k == key and v == value and bad for k, v, bad in muts) and \
        not any(k == key and v == value and not bad for k, v, bad in muts)


# ------------------------------------------------------------------ running and judging

def invariants(d: dict) -> list[str]:
    """The result's broken invariants (empty: all hold)."""
    bad = []
    missing = [k for k in RUN_KEYS if k not in d]
    if missing:
        return [f"missing keys {missing}"]
    for k, v in d.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (v < 0 or not math.isfinite(v)):
            bad.append(f"{k} = {v}")
    tot, cor = d["requests_total"], d["requests_corrupted"]
    if cor > tot:
        bad.append(f"requests_corrupted {cor} > requests_total {tot}")
    frac = cor / tot if tot else 0.0
    if abs(d["corrupted_fraction"] - frac) > 1e-9:
        bad.append(f"corrupted_fraction {d['corrupted_fraction']} != {cor}/{tot}")
    ab = d.get("requests_aborted", 0)
    if d.get("requests_completed", 0) + ab != tot:
        bad.append(f"requests_completed {d.get('requests_completed')} + aborted {ab} != requests_total {tot}")
    if ab != len(d.get("aborted_requests", [])) or any(not a.get("reason") for a in d.get("aborted_requests", [])):
        bad.append("aborted requests without a reason")
    if d["stale_reads"] + d["torn_reads"] > d.get("reads_total", math.inf):
        bad.append("stale + torn reads above reads_total")
    # (a request is corrupted by a read on the prefill side or on the byte-level decode side)
    listed = len(d.get("corrupted_reads", [])) + len((d.get("decode") or {}).get("corrupted_reads", []))
    if (cor > 0) != (listed > 0):
        bad.append(f"{cor} corrupted requests but {listed} corrupted reads listed")
    if max(d.get("requests_raced", 0), d.get("requests_wrong_kv", 0),
           (d.get("decode") or {}).get("requests_corrupted", 0)) > cor:
        bad.append("a side's corrupted requests above requests_corrupted")
    for pool, routines in d["branches"].items():
        if not isinstance(routines, dict) or any(not isinstance(n, int) or n < 0 for n in routines.values()):
            bad.append(f"branches[{pool}] = {routines}")
    if "corrupted_reads_by_rank" in d:
        by = d["corrupted_reads_by_rank"]
        if len(by) != d.get("simulated_ranks"):
            bad.append(f"corrupted_reads_by_rank has {len(by)} entries for {d.get('simulated_ranks')} ranks")
        if sum(by) != len(d["corrupted_reads"]):
            bad.append(f"corrupted_reads_by_rank sums to {sum(by)}, {len(d['corrupted_reads'])} corrupted reads")
    if not d.get("hicache", True) and (d["load_backs"] or d["branches"]):
        bad.append("HiCache off but load-backs or copy branches")
    dec = d.get("decode")
    if dec is not None:
        for k, v in dec.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                bad.append(f"decode.{k} = {v}")
        if dec["requests_corrupted"] > dec["requests"]:
            bad.append("decode: requests_corrupted > requests")
        if dec["requests"] > tot:
            bad.append(f"decode: {dec['requests']} requests > requests_total {tot}")
        if dec["stale_reads"] + dec["torn_reads"] > dec["reads_total"]:
            bad.append("decode: stale + torn above reads_total")
        if dec["requests_corrupted"] != len(dec.get("corrupted_rids", [])):
            bad.append("decode: requests_corrupted != len(corrupted_rids)")
        if dec["device_hit_tokens"] + dec["host_hit_tokens"] + dec["transfer_tokens"] > dec["input_tokens"]:
            bad.append("decode: hit + transferred tokens above input tokens")
        if dec["restores_failed"] > dec["requests"]:
            bad.append("decode: restores_failed above requests")
        if not dec["hicache"] and (dec["load_backs"] or dec["backups"]):
            bad.append("decode: HiCache off but load-backs or backups")
    return bad


_HEADS = {"deepseek-v4-flash": 64, "dsa-v3.2": 128}
_LAYERS = {"deepseek-v4-flash": 43, "dsa-v3.2": 61}
_BASE = {  # the keys of the presets that the combinations below read (docs/scenarios.md)
    "incident": dict(mode="pd", prefill_tp=4, decode_tp=4, gpus=8, hic_p=True, hic_d=False),
    "incident-short": dict(mode="pd", prefill_tp=4, decode_tp=4, gpus=8, hic_p=True, hic_d=False),
    "incident-repro": dict(mode="pd", prefill_tp=4, decode_tp=4, gpus=8, hic_p=True, hic_d=False),
    "glm5-22811": dict(mode="colocated", prefill_tp=8, decode_tp=8, gpus=8, hic_p=True, hic_d=True),
    "glm5-22811-small": dict(mode="colocated", prefill_tp=8, decode_tp=8, gpus=8, hic_p=True, hic_d=True),
}
_BOOL = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def must_refuse(case: Case) -> list[str]:
    """Impossible combinations in a preset case's final overrides (docs/scenarios.md's table):
    the keys a run must not accept.  Only the combinations the fuzzer can tell from the
    overrides alone (a case with a file or a trace is left to ``case.invalid``)."""
    if case.file_text is not None:
        return []
    o = {}
    for item in case.overrides:
        k, eq, v = item.partition("=")
        if eq:
            o[k] = v
    b = _BASE[case.preset]
    try:
        fam = o.get("model.family", PRESET_FAMILY[case.preset])
        if fam not in PAGE:
            return []
        ps = int(o.get("hicache.page_size", PAGE[PRESET_FAMILY[case.preset]]))
        ptp, dtp = int(o.get("deployment.prefill_tp", b["prefill_tp"])), int(o.get("deployment.decode_tp", b["decode_tp"]))
        gpus = int(o.get("deployment.gpus", b["gpus"]))
        mode = o.get("deployment.mode", b["mode"])
        hp = _BOOL[o.get("hicache.prefill", str(b["hic_p"]).lower())]
        hd = _BOOL[o.get("hicache.decode", str(b["hic_d"]).lower())]
        ranks = int(o.get("deployment.simulated_ranks", "1"))
        cps = int(o.get("scheduler.chunked_prefill_size", "-1"))
        mtt = int(o["scheduler.max_total_tokens"]) if "scheduler.max_total_tokens" in o else None
        layers = int(o.get("run.layers", "0"))
        min_layers = 3 if fam == "deepseek-v4-flash" else 1
        pd_keys = float(o.get("deployment.pd_transfer_gbps", "0")) != 0 or \
            float(o.get("deployment.pd_transfer_latency_us", "-1")) != -1
    except (ValueError, KeyError):
        return []
    bad = []
    if ps != PAGE[fam]:
        bad.append("hicache.page_size")
    if _HEADS[fam] % max(ptp, 1) or _HEADS[fam] % max(dtp, 1):
        bad.append("deployment.*_tp (heads)")
    if mode == "pd" and ptp > 0 and dtp > 0 and gpus % (ptp + dtp):
        bad.append("deployment.*_tp (gpus)")
    if mode == "colocated" and (dtp != ptp or (ptp > 0 and gpus % ptp) or hp != hd):
        bad.append("deployment colocated")
    if mode == "colocated" and pd_keys:
        bad.append("deployment.pd_transfer_* (colocated)")
    if cps != -1 and cps < ps:
        bad.append("scheduler.chunked_prefill_size")
    if mtt is not None and (mtt % ps or mtt < 2 * ps):
        bad.append("scheduler.max_total_tokens")
    if ranks > ptp:
        bad.append("deployment.simulated_ranks")
    if mode == "pd" and hd and fam == "deepseek-v4-flash":
        bad.append("hicache.decode (V4)")
    if layers > _LAYERS[fam] or 0 < layers < min_layers:
        bad.append("run.layers")
    return bad


def classify(case: Case, rc: int | None, stdout: str, stderr: str) -> tuple[str, str]:
    """(class, symptom) of a finished case (module doc); ``rc`` None: timed out."""
    if rc is None:
        return "BUG", "timeout"
    if "Traceback (most recent call last)" in stderr:
        last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1]
        return "BUG", f"traceback: {last[:300]}"
    if rc == 0:
        refuse = case.invalid or must_refuse(case)
        if refuse:
            return "BUG", f"accepted invalid input ({', '.join(refuse)})"
        try:
            d = json.loads(stdout)
        except json.JSONDecodeError as e:
            return "BUG", f"exit 0 but no JSON on stdout ({e.msg})"
        broken = invariants(d)
        return ("BUG", "invariant: " + "; ".join(broken)) if broken else ("OK", "")
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if len(lines) != 1:
        return "BUG", f"exit {rc} with {len(lines)} stderr lines: {' | '.join(lines)[:300]}"
    m = _ERROR_LINE.match(lines[0])
    if not m:
        return "BUG", f"exit {rc}, error without a key: {lines[0][:300]}"
    if "expected" not in m.group(2):
        return "BUG", f"exit {rc}, error says nothing expected: {lines[0][:300]}"
    if not user_key(m.group(1), case):
        return "BUG", f"exit {rc}, error names {m.group(1)!r}, which is no key the user wrote: {lines[0][:300]}"
    return "INPUT", m.group(1)


_SECTIONS = ("model", "variant", "deployment", "hicache", "scheduler", "workload", "run")
_TOP_KEYS = ("--set", "--seed", "scenario", "base", "name", "description")


def user_key(key: str, case: Case) -> bool:
    """Whether an error's key is one the user can act on: a scenario key (``section.key``), an
    override's own key, a CLI option, the scenario file or a trace file's ``FILE:LINE.key``."""
    if key in _TOP_KEYS or key.partition(".")[0] in _SECTIONS:
        return True
    if any(item.partition("=")[0].strip() == key for item in case.overrides):
        return True
    return key.endswith(".toml") or ".jsonl" in key or key.startswith("scenario ")


def export_violations(case: Case, d: dict, cmd: list[str], timeout: float, tmp: str,
                      checked: list | None = None) -> list[str]:
    """``--export`` mode, an OK case: the same run with ``--export-races D --export-limit 2``
    (the whole run kept, ``keep="all"``, the decode side's too) must give the streamed run's
    JSON ``d`` (wall time and the export's keys aside), and every window it wrote must rerun
    (``kvrace schedule run``'s path) with its read stale or torn; the names of the windows
    checked are appended to ``checked``."""
    from sim.executor import run_schedule
    from sim.profile import load_profile
    from sim.schedule import load
    from sim.verdicts import analyse

    out = os.path.join(tmp, f"export_{case.index}")
    try:
        p = subprocess.run(cmd + ["--export-races", out, "--export-limit", "2"], cwd=ROOT, capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    except subprocess.TimeoutExpired:
        return ["the exporting run timed out"]
    if p.returncode != 0 or "Traceback" in p.stderr:
        return [f"the exporting run exited {p.returncode}: {p.stderr.strip()[-300:]}"]
    kept = json.loads(p.stdout)
    skip = {"wall_time_s", "exported_races", "exported_races_skipped"}
    broken = [f"keep=all differs at {k}" for k in sorted(set(d) | set(kept)) if k not in skip
              and d.get(k) != kept.get(k)]
    # NOTE: under `kvrace schedule run`'s default profile (h200), as a user reruns the file
    prof = load_profile("h200")
    for path in kept.get("exported_races", []):
        name = os.path.basename(path)
        op = name.split("_", 3 if name.startswith("decode_") else 2)[-1][:-len(".json")]
        rep = analyse(run_schedule(load(path), prof))
        status = next((e["status"] for e in rep["reads"] if e["op"] == op), None)
        if status not in ("stale", "torn"):
            broken.append(f"exported window {os.path.basename(path)}: its read is {status}")
        if checked is not None:
            checked.append(name)
    return broken


def run_case(case: Case, timeout: float = 60.0, tmp: str | None = None, export: bool = False) -> Outcome:
    tmp = tmp or tempfile.mkdtemp(prefix="kvfuzz")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "bad_gate.toml"), "w") as f:
        f.write("[gated\nx = 1\n")
    target = case.preset
    over = list(case.overrides)
    if case.trace_text is not None:
        p = os.path.join(tmp, f"trace_{case.index}.jsonl")
        with open(p, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(case.trace_text)
        over.append(f"workload.trace={p}")
    if case.profile_text is not None:
        p = os.path.join(tmp, f"profile_{case.index}.toml")
        with open(p, "w") as f:
            f.write(case.profile_text)
        over.append(f"deployment.profile={p}")
    if case.file_text is not None:
        target = os.path.join(tmp, f"case_{case.index}.toml")
        with open(target, "w") as f:
            f.write(case.file_text)
    cmd = [sys.executable, "-m", "kvrace", "run", target, "--json", "-", "--progress", "never"]
    for o in over:
        cmd += ["--set", o]
    if case.seed_arg is not None:
        cmd += ["--seed", str(case.seed_arg)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": ROOT})
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, "", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else ""
    wall = time.monotonic() - t0
    klass, symptom = classify(case, rc, out, err)
    d = json.loads(out) if klass == "OK" else {}
    if klass == "OK" and case.evict and expected_clean(case):
        broken = clean_violations(d)
        if broken:
            klass, symptom = "BUG", "expected clean (0.5.11, none, fence on): " + ", ".join(broken)
    windows: list[str] = []
    if klass == "OK" and export:
        broken = export_violations(case, d, cmd, timeout, tmp, windows)
        if broken:
            klass, symptom = "BUG", "export: " + "; ".join(broken)[:400]
    feats = features(d) if d else ()
    res = {k: v for k, v in d.items() if isinstance(v, (int, float, str))}
    if isinstance(d.get("decode"), dict):
        res["decode"] = {k: v for k, v in d["decode"].items() if isinstance(v, (int, float, str))}
        res["decode"]["corrupted_rids"] = d["decode"].get("corrupted_rids", [])
    if export:
        res["exported_windows"] = windows
    res["corrupted_rids"] = sorted({q for r in d.get("corrupted_reads", []) for q in r.get("requests", [])})
    res["wrong_kv_rids"] = sorted({q for r in d.get("corrupted_reads", []) for q in r.get("wrong_kv_requests", [])})
    return Outcome(case, klass, symptom, rc, wall, err[-2000:] if klass == "BUG" else "", feats, res)


def features(d: dict) -> tuple:
    """What an OK run exercised, for the table."""
    f = []
    if d["load_backs"]:
        f.append("load-backs")
    if d.get("simulated_ranks", 1) > 1:
        f.append("ranks>1")
    if "decode" in d:
        f.append("decode-hicache" if d["decode"]["hicache"] else "decode-bytes")
        if d["decode"]["load_backs"]:
            f.append("decode-load-backs")
    if d.get("requests_aborted"):
        f.append("aborts")
    if d["requests_corrupted"]:
        f.append("corrupted")
    if d.get("chunked_batches"):
        f.append("chunked")
    if not d.get("hicache", True):
        f.append("hicache-off")
    return tuple(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--bugs", default="fuzz_bugs.json", help="where the bugs go (JSON)")
    ap.add_argument("--first", type=int, default=0, help="first case index (resume)")
    ap.add_argument("--stress", action="store_true", help="valid cases made to load back (draw_stress_case)")
    ap.add_argument("--evict", action="store_true",
                    help="valid cases under heavy eviction (draw_evict_case): tables load-back coverage per "
                         "hypothesis, checks runs expected clean, and every --pair-every'th case with TP >= 2 "
                         "on 1 and 2 simulated ranks (rank_agreement)")
    ap.add_argument("--pair-every", type=int, default=4)
    ap.add_argument("--boundaries", action="store_true",
                    help="instead of drawn cases, every numeric key at its lower bound and at huge values "
                         "(boundary_cases; --cases, --seed and --first are ignored)")
    ap.add_argument("--export", action="store_true",
                    help="also run each OK case with --export-races (the whole run kept): its JSON must equal the "
                         "streamed run's and every exported window must rerun with its read stale or torn")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kvfuzz")
    rng = random.Random(a.seed)
    if a.evict:
        return _main_evict(a, rng, tmp)
    draw = (lambda r, i: draw_stress_case(r, i)) if a.stress else (lambda r, i: draw_case(r, i, tmp))
    cases = boundary_cases() if a.boundaries else [draw(rng, i) for i in range(a.first + a.cases)][a.first:]
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.jobs) as ex:
        for o in ex.map(lambda c: run_case(c, a.timeout, tmp, a.export), cases):
            outcomes.append(o)
            mark = "" if o.klass != "BUG" else f"  {o.symptom[:150]}"
            what = f" {o.case.overrides[-1]}" if a.boundaries else ""
            print(f"[{o.case.index:4d}] {o.klass:5s} {o.wall_s:5.1f}s {o.case.preset}{what}{mark}", flush=True)
    classes = ("OK", "INPUT", "BUG")
    kind = "boundary " if a.boundaries else "stress " if a.stress else ""
    print(f"\n{len(outcomes)} {kind}cases, seed {a.seed}, {time.monotonic() - t0:.0f} s")
    print(f"{'preset':<18}" + "".join(f"{c:>7}" for c in classes))
    for p in PRESETS:
        row = [sum(o.klass == c and o.case.preset == p for o in outcomes) for c in classes]
        print(f"{p:<18}" + "".join(f"{n:>7}" for n in row))
    print(f"{'all':<18}" + "".join(f"{sum(o.klass == c for o in outcomes):>7}" for c in classes))
    if a.export:
        names = [w for o in outcomes for w in o.result.get("exported_windows", [])]
        print(f"exported windows rerun: {len(names)} ({sum(w.startswith('decode_') for w in names)} of the decode "
              "side), each with its read stale or torn unless a BUG above says otherwise")
    feats: dict[str, int] = {}
    for o in outcomes:
        for f in o.features:
            feats[f] = feats.get(f, 0) + 1
    print("OK runs exercising: " + ", ".join(f"{k} {n}" for k, n in sorted(feats.items(), key=lambda x: -x[1])))
    keys: dict[str, int] = {}
    for o in outcomes:
        if o.klass == "INPUT":
            keys[o.symptom] = keys.get(o.symptom, 0) + 1
    print("input errors by key: " + ", ".join(f"{k} {n}" for k, n in sorted(keys.items(), key=lambda x: -x[1])))
    bugs = [{"preset": o.case.preset, "overrides": o.case.overrides, "invalid": o.case.invalid,
             "file_text": o.case.file_text, "trace_text": o.case.trace_text, "seed_arg": o.case.seed_arg,
             "index": o.case.index, "symptom": o.symptom, "rc": o.rc, "stderr_tail": o.stderr_tail}
            for o in outcomes if o.klass == "BUG"]
    with open(a.bugs, "w") as f:
        json.dump(bugs, f, indent=1)
    print(f"{len(bugs)} bugs written to {a.bugs}")
    return 0


def _hyp(case: Case) -> str:
    return next((o.partition("=")[2] for o in case.overrides if o.startswith("variant.hypotheses=")), "") or "none"


def _main_evict(a, rng: random.Random, tmp: str) -> int:
    cases = [draw_evict_case(rng, i) for i in range(a.first + a.cases)][a.first:]
    pairs = [c for c in cases if a.pair_every > 0 and c.index % a.pair_every == 0
             and not any(o in c.overrides for o in ("deployment.prefill_tp=1",))]
    jobs = [("case", c) for c in cases] + [("pair", c) for c in pairs]

    def go(job):
        kind, c = job
        if kind == "case":
            return kind, run_case(c, a.timeout, tmp)
        return kind, (run_case(with_ranks(c, 1), a.timeout, tmp), run_case(with_ranks(c, 2), a.timeout, tmp))

    outcomes: list[Outcome] = []
    bugs = []
    pair_rows = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.jobs) as ex:
        for kind, res in ex.map(go, jobs):
            if kind == "case":
                o = res
                outcomes.append(o)
                mark = "" if o.klass != "BUG" else f"  {o.symptom[:150]}"
                print(f"[{o.case.index:4d}] {o.klass:5s} {o.wall_s:5.1f}s {o.case.preset} {_hyp(o.case)} "
                      f"load_backs {o.result.get('load_backs', '-')}{mark}", flush=True)
                if o.klass == "BUG":
                    bugs.append({"preset": o.case.preset, "overrides": o.case.overrides, "index": o.case.index,
                                 "profile_text": o.case.profile_text, "symptom": o.symptom, "rc": o.rc,
                                 "stderr_tail": o.stderr_tail})
            else:
                one, two = res
                broken = rank_agreement(one, two)
                pair_rows.append((one.case.index, one.case.profile_text is not None, broken,
                                  bool(one.result.get("wrong_kv_rids") or two.result.get("wrong_kv_rids"))))
                print(f"[{one.case.index:4d}] pair 1/2 ranks: {'; '.join(broken) or 'agree'}", flush=True)
                if counts_as_bug(one, two, broken):
                    bugs.append({"preset": one.case.preset, "overrides": one.case.overrides, "index": one.case.index,
                                 "profile_text": None, "symptom": "1 vs 2 ranks without launch jitter: "
                                 + "; ".join(broken), "rc": 0, "stderr_tail": ""})
    print(f"\n{len(outcomes)} evict cases, seed {a.seed}, {time.monotonic() - t0:.0f} s")
    print(f"{'class':<8}" + "".join(f"{c:>7}" for c in ("OK", "INPUT", "BUG")))
    print(f"{'all':<8}" + "".join(f"{sum(o.klass == c for o in outcomes):>7}" for c in ("OK", "INPUT", "BUG")))
    print(f"\n{'OK runs by':<24}{'OK':>5}{'load-backs':>11}{'dec-loads':>10}{'corrupted':>10}{'clean-chk':>10}")
    groups = [(h, lambda o, h=h: _hyp(o.case) == h) for h in sorted({_hyp(o.case) for o in outcomes})]
    groups += [(w, lambda o, w=w: f"hicache.write_policy={w}" in o.case.overrides)
               for w in ("write_through", "write_through_selective", "write_back")]
    groups += [("ranks>1", lambda o: o.result.get("simulated_ranks", 1) > 1),
               ("launch jitter", lambda o: o.case.profile_text is not None),
               ("overlap loop", lambda o: "scheduler.event_loop=overlap" in o.case.overrides),
               ("pd + decode hicache", lambda o: "decode" in o.result and o.result["decode"].get("hicache")),
               ("all", lambda o: True)]
    for h, pick in groups:
        sel = [o for o in outcomes if o.klass == "OK" and pick(o)]
        lb = sum(o.result.get("load_backs", 0) > 0 for o in sel)
        dl = sum((o.result.get("decode") or {}).get("load_backs", 0) > 0 for o in sel)
        cor = sum(o.result.get("requests_corrupted", 0) > 0 for o in sel)
        cl = sum(expected_clean(o.case) for o in sel)
        print(f"{h:<24}{len(sel):>5}{lb:>11}{dl:>10}{cor:>10}{cl:>10}")
    if pair_rows:
        agree = [r for r in pair_rows if not r[2]]
        print(f"\nrank pairs (1 vs 2 simulated ranks): {len(pair_rows)}, agree {len(agree)}; "
              f"disagreeing: with launch jitter {sum(r[1] for r in pair_rows if r[2])}, "
              f"with wrong-kv reads {sum(r[3] for r in pair_rows if r[2])} (without jitter or raced reads: a bug)")
        for idx, jit, broken, _ in pair_rows:
            if broken:
                print(f"  case {idx} (jitter {jit}): {'; '.join(broken)}")
    with open(a.bugs, "w") as f:
        json.dump(bugs, f, indent=1)
    print(f"{len(bugs)} bugs written to {a.bugs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
