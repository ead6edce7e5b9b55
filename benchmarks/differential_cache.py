"""Differential check of kvrace's HiRadixCache against SGLang 0.5.14's own, op by op.

    PYTHONPATH=/path/to/sglang/python:. python benchmarks/differential_cache.py \\
        [--sequences K] [--length N] [--seed S] [--page-size 1|16|64|256 ...] [--policy P ...] \\
        [--layout L/IO ...] [--radix] [--requests] [--no-shrink] [--all]

``--requests`` draws request sequences (``generate_requests``) instead: admissions (with
host hits loaded back), chunked prefill through ``cache_unfinished_req``, decode steps and
``cache_finished_req``, each side with its own ``Req`` and ``ReqToTokenPool``; with
``--radix`` on the plain ``RadixCache``.

``--radix`` compares the plain ``RadixCache`` (HiCache off) instead: every chosen page size
and eviction policy, with and without EAGLE bigram keys, on ``generate_radix`` sequences
(``--policy``, ``--layout``, ``--ratio`` and ``--scenarios`` do not apply).

Runs K random operation sequences (``tests/differential/ops.py``) for every chosen
configuration on both caches (``tests/differential/sglang_side.py``,
``tests/differential/kvrace_side.py``), compares the canonical observation after every op
(``tests/differential/compare.py``) and prints the first divergence: the configuration, the
op sequence that led there (shrunk by deleting ops while the same field still diverges,
unless ``--no-shrink``), and the differing fields of both observations.  ``--all`` goes on
after a divergence and prints one per configuration.  Exit status 1 when any diverged.

Needs torch and SGLang 0.5.14 importable (see tests/differential/README.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("layer_first/kernel", "page_first/kernel", "page_first_direct/direct", "layer_first/direct")
POLICIES = ("write_through", "write_through_selective", "write_back")
#: page sizes a configuration may have (256: the incident's HiCache page)
PAGE_SIZES = (1, 16, 64, 256)


def _short(op: dict) -> str:
    d = dict(op)
    if "tokens" in d:
        t = d["tokens"]
        d["tokens"] = _runs(t)
    return json.dumps(d)


def _runs(tokens) -> str:
    """Tokens as runs: ``[0x64, 2x3, 1]``."""
    out, i = [], 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and tokens[j] == tokens[i]:
            j += 1
        out.append(f"{tokens[i]}x{j - i}" if j - i > 1 else str(tokens[i]))
        i = j
    return "[" + ", ".join(out) + "]"


def _fields(div) -> set:
    return {f for f, _, _ in div[2]}


def shrink(cfg, ops: list[dict], first, budget_s: float = 120.0, error_kind: bool = True):
    """Delete ops (chunks, then single ops) while the run still diverges in one of the same
    fields; unlock ops whose lock was deleted are dropped with it."""
    from tests.differential.compare import run_pair

    want = _fields(first)
    best, best_div = list(ops[:first[0] + 1]), first
    t0 = time.monotonic()

    def still(cand):
        held = {o["h"] for o in cand if o["op"] in ("lock", "load")}
        cand = [o for o in cand if o["op"] != "unlock" or o["h"] in held]
        r = run_pair(cfg, cand, error_kind=error_kind)
        return (cand, r[0]) if r and _fields(r[0]) & want else (None, None)

    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.monotonic() - t0 < budget_s:
        i, changed = 0, False
        while i < len(best) and time.monotonic() - t0 < budget_s:
            cand, div = still(best[:i] + best[i + chunk:])
            if cand is not None:
                best, best_div, changed = cand[:div[0] + 1], div, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return best, best_div


def report(cfg, ops, div) -> str:
    from tests.differential.compare import format_diff

    i, op, d, _a, _b = div
    lines = [f"DIVERGENCE  {cfg.describe()}", f"  at op {i}: {_short(op)}", "  ops:"]
    lines += [f"    {k:3d} {_short(o)}" for k, o in enumerate(ops[:i + 1])]
    lines.append("  observation diff (sglang vs kvrace):")
    lines.append(format_diff(d))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=20, help="sequences per configuration (20)")
    ap.add_argument("--length", type=int, default=60, help="random ops per sequence (60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 64], choices=PAGE_SIZES,
                    help="page sizes (1 64); the device pool holds 48 tokens at page 1, else 8 pages")
    ap.add_argument("--model", nargs="+", default=["mla"], choices=["mla", "dsa"],
                    help="device pool family (dsa: page size 64 only; SGLang's HostPoolGroup + HybridCacheController)")
    ap.add_argument("--policy", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--layout", nargs="+", default=[LAYOUTS[0]], choices=LAYOUTS)
    ap.add_argument("--need-sort", action="store_true", help="allocators with need_sort (PD disaggregation)")
    ap.add_argument("--ratio", type=float, nargs="+", default=[2.0],
                    help="hicache_ratio values (2.0; 1.1 keeps the host pool nearly full)")
    ap.add_argument("--scenarios", action="store_true", help="also run the hand-written scenarios")
    ap.add_argument("--eviction-policy", nargs="+", default=["lru"],
                    choices=["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"])
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--ignore-error-kind", action="store_true",
                    help="an op failing on both sides agrees whatever the exception kinds (past FINDINGS.md F2)")
    ap.add_argument("--all", action="store_true", help="report one divergence per configuration")
    ap.add_argument("--extra-keys", action="store_true",
                    help="a fifth of the sequences namespaced by an extra_key (always so with --radix)")
    ap.add_argument("--radix", action="store_true",
                    help="the plain RadixCache (HiCache off), with and without EAGLE bigram keys")
    ap.add_argument("--requests", action="store_true",
                    help="request sequences: cache_unfinished_req / cache_finished_req with Req and ReqToTokenPool")
    args = ap.parse_args(argv)

    from tests.differential.sglang_side import DiffConfig, device_tokens_for, sglang_available

    ok, why = sglang_available()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    from tests.differential.compare import run_pair
    from tests.differential.ops import SCENARIOS, generate, generate_radix, generate_requests

    def configs():
        if args.radix:
            for ps, evp, eagle in ((p, e, g) for p in args.page_size for e in args.eviction_policy
                                   for g in (False, True)):
                yield DiffConfig(page_size=ps, device_tokens=device_tokens_for(ps), hicache=False, is_eagle=eagle,
                                 need_sort=args.need_sort, eviction_policy=evp)
            return
        for model, ps in ((m, p) for m in args.model for p in args.page_size if m == "mla" or p == 64):
            for policy, lay, ratio, evp in ((pol, lay, r, e) for pol in args.policy for lay in args.layout
                                            for r in args.ratio for e in args.eviction_policy):
                layout, io = lay.split("/")
                yield DiffConfig(model=model, page_size=ps, device_tokens=device_tokens_for(ps), write_policy=policy,
                                 layout=layout, io_backend=io, need_sort=args.need_sort, hicache_ratio=ratio,
                                 eviction_policy=evp)

    def sequence(cfg, seed) -> list[dict]:
        if args.requests:
            return generate_requests(seed, args.length, page_size=cfg.page_size, device_tokens=cfg.device_tokens,
                                     hicache=cfg.hicache)
        if not cfg.hicache:
            return generate_radix(seed, args.length, page_size=cfg.page_size, device_tokens=cfg.device_tokens)
        return generate(seed, args.length, page_size=cfg.page_size, device_tokens=cfg.device_tokens,
                        extra_keys=args.extra_keys)

    diverged = 0
    total_ops = 0
    t0 = time.monotonic()
    for cfg in configs():
        runs = [(args.seed * 100003 + k, None) for k in range(args.sequences)]
        if args.scenarios and cfg.hicache:
            runs += [(name, fn) for name, fn in SCENARIOS.items()]
        for seed, fn in runs:
            ops = sequence(cfg, seed) if fn is None else fn(cfg.page_size, cfg.device_tokens)
            res = run_pair(cfg, ops, error_kind=not args.ignore_error_kind)
            total_ops += len(ops) if not res else res[0][0] + 1
            if not res:
                continue
            diverged += 1
            sops, sdiv = (ops[:res[0][0] + 1], res[0]) if args.no_shrink else shrink(
                cfg, ops, res[0], error_kind=not args.ignore_error_kind)
            print(f"[seed {seed}, {len(ops)} ops, shrunk to {len(sops)}]", flush=True)
            print(report(cfg, sops, sdiv))
            print()
            if not args.all:
                return 1
            break
        else:
            print(f"ok  {cfg.describe()}: {len(runs)} sequences", flush=True)
    dt = time.monotonic() - t0
    print(f"{total_ops} ops compared in {dt:.1f} s; {diverged} configuration(s) diverged")
    return 1 if diverged else 0

if __name__ == "__main__":
    sys.exit(main())
