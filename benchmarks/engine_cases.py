"""The engine cases every speed change is checked against: the sha256 of each case's whole
``EngineResult`` in the source tree this runs in (issue 9's speed work: a change that makes the
engine faster must leave every result as it was).

    cd TREE && PYTHONPATH=TREE python benchmarks/engine_cases.py [CASE ...] [--json OUT]

``TREE`` is a checkout or ``git archive <commit> | tar -x -C TREE``; run it in two trees and
compare the columns.  The digest is the one ``bench_bytes_ab.py`` prints (``result_sha256``:
``dataclasses.asdict`` of the result but ``wall_time_s`` and, while zero, ``requests_retracted``
and ``graph_replays`` (added later), JSON with sorted keys), so the two agree on a case they
share.  The cases: wrong-KV and raced reads of every hypothesis on
``incident-short``, the 0.5.10 gate map of ``glm5-22811-small`` at two concurrencies, the
overlap loop unfenced on a tight pool, two TP ranks (``incident-repro``), and 45 and 100
simulated seconds of ``incident``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time

from tests.test_engine_overlap import FENCE, FENCE_SEED   # the fence tests' workload (one home)

V4 = ["run.layers=4", "run.duration_s=1.5", "workload.concurrency=4", "model.index_k_dtype=fp8"]
#: name -> (scenario, overrides, seed)
CASES = {
    "notbacked": ("incident-short", [*V4, "variant.hypotheses=index-k-not-backed-up"], 0),
    "glm510": ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10"], 0),
    "glm510c6": ("glm5-22811-small", ["run.layers=2", "variant.gate_map=upstream-0.5.10",
                                      "workload.concurrency=6"], 1),
    # NOTE: test_engine_overlap's FENCE workload and seed: a run whose freed page reaches a load-back
    # in time, so the case has corrupted reads
    "unfenced": ("glm5-22811-small", ["run.layers=4", "variant.gate_map=upstream-0.5.11",
                                      "scheduler.event_loop=overlap", "variant.hypotheses=load-unfenced", *FENCE], FENCE_SEED),
    "repro": ("incident-repro", ["run.duration_s=1"], 0),
    "stride": ("incident-short", ["run.layers=4", "run.duration_s=3", "model.index_k_dtype=bf16",
                                  "variant.hypotheses=index-k-stride-mismatch"], 0),
    "c4tok": ("incident-short", [*V4[:3], "model.index_k_dtype=bf16", "variant.hypotheses=index-k-c4-token-copy"], 0),
    "hostfreed": ("incident-short", [*V4, "variant.hypotheses=host-freed-during-load"], 0),
    "glm5small": ("glm5-22811-small", [], 0),
    "incident45": ("incident", ["run.duration_s=45"], 0),
    "incident100": ("incident", ["run.duration_s=100"], 0),
}


def run_case(name: str) -> dict:
    from sim.engine.engine import LATE_FIELDS, PrefillEngine
    from sim.engine.scenario import load_scenario
    scenario, sets, seed = CASES[name]
    engine = PrefillEngine(load_scenario(scenario, sets), seed, keep="report")
    t0 = time.process_time()
    r = engine.run()
    cpu = time.process_time() - t0
    d = dataclasses.asdict(r)
    d.pop("wall_time_s")
    # NOTE: fields added after the first digests, left out while they are zero, so a result
    # without them digests as it did before they existed
    # (sim.engine.engine.LATE_FIELDS; bench_bytes_ab.py does the same, and its child runs in
    # trees of any age, so it has its own copy)
    for late in LATE_FIELDS:
        if late in d and not d[late]:
            d.pop(late)
    return {"case": name, "result_sha256": hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest(),
            "cpu_s": round(cpu, 2), "reads": r.reads_total, "corrupted": r.requests_corrupted,
            "wrong_kv_reads": r.wrong_kv_reads, "stale": r.stale_reads, "torn": r.torn_reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"some of {list(CASES)} (default: all)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}: expected one of {list(CASES)}")
    rows = []
    print("| case | result sha256 | CPU s | reads | corrupted | wrong-KV reads | stale | torn |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.cases or list(CASES):
        r = run_case(name)
        rows.append(r)
        print(f"| {name} | `{r['result_sha256'][:12]}` | {r['cpu_s']} | {r['reads']} | {r['corrupted']} | "
              f"{r['wrong_kv_reads']} | {r['stale']} | {r['torn']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
