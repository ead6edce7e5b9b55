"""HiCache model with the executor attached: cache operations per wall second on a multi-turn workload.

    python benchmarks/bench_cache.py [--sessions 6 20 60] [--turns 10] [--final-tokens 80000]
                                     [--layers 61] [--device-frac 0.25] [--hicache-ratio 4.0]
                                     [--seed 0] [--prefill-us 0.6] [--profile-biggest] [--json OUT]

The defaults are the issue's target size (60 sessions x 80k tokens x 61 layers), which the
model cannot run in reasonable time yet (see the measured numbers at the end of this doc);
the measured runs used ``--layers 4 --final-tokens 8000``.

The workload: ``S`` chat sessions share a system prompt and each re-sends its growing
conversation every turn, so a session's prefix grows turn by turn to about
``--final-tokens`` tokens (80k).  Turns are served one request per scheduler iteration, in
rounds; each round visits the sessions in a seeded random order, so between two turns of
one session the others' prefills push its prefix off the device.  One iteration (one
request) is what SGLang's scheduler does around a prefill with HiCache:

1. ``check_hicache_events()``: poll the backup and load acks (``query``), unlock, free;
2. ``match_prefix(key)``: the device hit and the host hit below it;
3. a host hit: ``init_load_back`` (device slots allocated, nodes resident and locked; may
   ``evict`` the device) and ``inc_lock_ref`` of the request's last node;
4. ``ready_to_load_host_cache()``: ``start_loading`` issues the merged load (start event,
   per layer the latent and index-K copies and the layer's event);
5. allocate the new tokens' slots (``evict`` what is missing first: device pressure);
6. the forward pass: per layer, ``wait_until(layer)`` on the load's producer slot (the
   gated accessor), a ``compute`` op (``--prefill-us`` per new token: the layer's
   attention and MLP), then the layer's latent and index-K ``write`` ops of the new tokens;
   the scheduler waits for the forward stream (``copy_done.synchronize()``);
7. ``insert(key, prefix slots + new slots)``: write_through backs the new leaf up at once
   (``start_writing``: one all-layer backup on the write stream; a full host pool makes
   ``write_backup`` call ``evict_host``), duplicates freed, ``dec_lock_ref``.

The decode tokens of a turn are not run: the assistant's reply is part of the next turn's
prompt (prefilled then), so each turn's new tokens stand for user message + reply.  Token
counts are multiples of the page size (64; SGLang's paged allocator ``alloc_extend`` handles
ragged tails, the benchmark does not need them).  The shared system prompt is a twentieth
of the final prefix.

Model: DSA (``DSATokenToKVPool``: fp8 latent rows plus the index-K sidecar pages, page
size 64), ``--layers`` (61, DeepSeek V3.2), ``page_first`` host layout with the ``kernel``
io backend (SGLang's defaults), ``write_through``, compact byte model
(``materialise=False``).  The device pool holds ``--device-frac`` of the final working set
(shared prompt + every session's final prefix), the host pool ``--hicache-ratio`` times the
device pool (SGLang's ``hicache_ratio``).

Driven through ``CacheSession.cache`` (each tree call followed by ``controller.settle()``)
and ``session.host`` for the forward pass.  The session records every op issued into its
schedule builder (so the run can be re-run statically); a real engine would not pay that,
the profile shows its share.

"Cache operations" counts the tree calls of the list above (``check_hicache_events``,
``match_prefix``, ``init_load_back``, ``inc_lock_ref``, ``ready_to_load_host_cache``,
``evict``, ``insert``, ``dec_lock_ref``); "executor ops" are the ops the scheduler host
issued (stream ops, queries, syncs).  Each size runs in its own process.

Measured 2026-12-01 on the project's development machine (``lscpu``: ``AMD EPYC``; ``nproc``: 2,
shared with other jobs; Python 3.11.7, numpy 2.4.6, simpy 4.1.2) with

    python benchmarks/bench_cache.py --sessions 6 20 60 --layers 4 --final-tokens 8000 --profile-biggest

    python benchmarks/bench_cache.py --sessions 6 --layers 61 --final-tokens 8000

(60 sessions x 8k tokens x 4 layers: 105 s wall, 98 s CPU, 40 cache ops per wall second, peak
RSS 1.6 GiB; 6 sessions x 8k x 61 layers: 75 s CPU, 5.4 cache ops per CPU second, 275
executor ops per request).  The full size (60 sessions x 80k tokens x 61 layers) was not
run.  EXTRAPOLATED, not measured: the cost is 8.5-11 CPU us per token-layer moved (loaded +
prefilled) and 165-250 MB of peak RSS per million token-layers in all four runs; the full
size moves about 1.34 billion token-layers (ten times the 60 x 8k run's tokens, 61 layers),
so about 3-4 CPU hours, about 0.3 cache ops per CPU second, and about 250 GB of memory.
Where the time goes (cProfile of the 60 x 8k x 4 run): half in ``start_loading`` planning
the load copies, nearly all of it ``sim.transfers.routines._indices`` checking index lists
element by element (the host pools hand the routines Python lists), and most of the rest in
the compact byte model applying the copies (``Executor._advance``).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.cache import CacheSession  # noqa: E402
from sim.cache.radix import RadixKey  # noqa: E402
from sim.cache.records import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams  # noqa: E402

PAGE = 64
STALL_US = 50.0               # host wait before re-polling acks when eviction falls short


def system_tokens(final_tokens: int) -> int:
    """The system prompt every session shares: a twentieth of the final prefix, in pages
    (4,032 tokens for 80k)."""
    return max(PAGE, round(final_tokens / 20 / PAGE) * PAGE)


def plan(sessions: int, turns: int, final_tokens: int, seed: int):
    """Per session, its token ids (final length) and the prefix length sent at each turn.

    Turn increments are drawn from 0.5..1.5 of the mean and scaled so the last turn sends
    ``final_tokens`` (rounded to pages); all lengths are page multiples."""
    rng = np.random.default_rng(seed)
    system = np.arange(1, system_tokens(final_tokens) + 1, dtype=np.int64)
    shared = len(system)
    convs, lens = [], []
    own = final_tokens - shared
    for i in range(sessions):
        w = rng.uniform(0.5, 1.5, turns)
        cum = np.cumsum(w) / w.sum() * own
        pages = np.maximum(np.round(cum / PAGE).astype(np.int64), np.arange(1, turns + 1))
        lens.append(shared + pages * PAGE)
        body = 10_000_000 * (i + 1) + np.arange(int(pages[-1]) * PAGE, dtype=np.int64)
        convs.append(np.concatenate([system, body]))
    order = []
    for t in range(turns):
        for i in rng.permutation(sessions):
            order.append((int(i), t))
    return convs, lens, order


class Bench:
    def __init__(self, sessions, turns, final_tokens, layers, device_frac, hicache_ratio, seed, layer_us):
        self.layer_us = layer_us
        self.convs, self.lens, self.order = plan(sessions, turns, final_tokens, seed)
        system = system_tokens(final_tokens)
        working = system + sum(int(x[-1]) - system for x in self.lens)
        device_tokens = max(3 * final_tokens, int(working * device_frac)) // PAGE * PAGE
        self.s = CacheSession(model="dsa", layers=layers, page_size=PAGE, device_tokens=device_tokens,
                              hicache_ratio=hicache_ratio, layout="page_first", io_backend="kernel",
                              write_policy="write_through", materialise=False, seed=seed)
        self.layers = layers
        self.working = working
        self.device_tokens = device_tokens
        self.host_tokens = int(self.s.host_pool.size) if hasattr(self.s.host_pool, "size") else None
        self.counts = dict(cache_ops=0, requests=0, device_hit_tokens=0, host_hit_tokens=0, load_backs=0,
                           loaded_tokens=0, backups=0, evict_calls=0, prefill_tokens=0, stalls=0)

    def _op(self, fn, *a):
        self.counts["cache_ops"] += 1
        return fn(*a)

    def forward(self, slots: np.ndarray, owner: int, producer: int) -> None:
        """The prefill's KV writes, layer by layer behind the load's layer events."""
        s, host = self.s, self.s.host
        counter = s.controller.layer_done_counter
        if producer >= 0:
            counter.set_consumer(producer)
        pages = np.unique(slots // PAGE).tolist()
        rows = slots.tolist()
        for layer in range(self.layers):
            if producer >= 0:
                counter.wait_until(layer, "forward")
            host.issue({"op": "compute", "stream": "forward", "duration_us": self.layer_us * len(rows)})
            for name, lay in s.device_pool.layouts.items():
                host.issue({"op": "write", "stream": "forward", "buffer": name, "layer": layer,
                            "units": rows if lay.entries_per_page == 1 else pages, "owner": owner,
                            "version": 1})
        s._block(host.synchronize(stream="forward"))

    def request(self, rid: int, sess: int, turn: int) -> None:
        c, cache, s = self.counts, self.s.cache, self.s
        n = int(self.lens[sess][turn])
        key = RadixKey(self.convs[sess][:n])
        self._op(cache.check_hicache_events)
        m = self._op(cache.match_prefix, MatchPrefixParams(key))
        prefix = m.device_indices
        node = m.last_device_node
        c["device_hit_tokens"] += len(prefix)
        if m.host_hit_length > 0:
            c["host_hit_tokens"] += m.host_hit_length
            loaded, node = self._op(cache.init_load_back, InitLoadBackParams(m.best_match_node, m.host_hit_length))
            if len(loaded):
                c["load_backs"] += 1
                c["loaded_tokens"] += len(loaded)
                prefix = np.concatenate([prefix, loaded])
        self._op(cache.inc_lock_ref, node)
        producer = self._op(cache.ready_to_load_host_cache)
        need = n - len(prefix)
        slots = s.allocator.alloc(need)
        waited = 0
        while slots is None:
            # NOTE: nodes whose backup is still in flight stay locked until its ack; when
            # eviction cannot free enough, the scheduler waits (a short host delay) and polls
            # the acks again, as SGLang's scheduler would retry the request next iteration
            if waited:
                s.advance(STALL_US)
                self._op(cache.check_hicache_events)
            self._op(cache.evict, EvictParams(need - s.allocator.available_size()))
            c["evict_calls"] += 1
            slots = s.allocator.alloc(need)
            waited += 1
            if waited > 10_000:
                raise RuntimeError(f"device pool too small: {need} tokens for request {rid} "
                                   f"({s.allocator.available_size()} free after eviction)")
        c["stalls"] += max(0, waited - 1)
        c["prefill_tokens"] += need
        self.forward(slots, rid, producer)
        writes_before = s.controller.writes_started
        res = self._op(cache.insert, InsertParams(key, np.concatenate([prefix, slots])))
        c["backups"] += s.controller.writes_started - writes_before
        if res.prefix_len > len(prefix):
            s.allocator.free(slots[:res.prefix_len - len(prefix)])
        self._op(cache.dec_lock_ref, node)
        c["requests"] += 1

    def run(self) -> None:
        for rid, (sess, turn) in enumerate(self.order):
            self.request(rid, sess, turn)
        self.s.wait_idle()
        self._op(self.s.cache.check_hicache_events)


def executor_ops(s: CacheSession) -> int:
    return len(s._ex.builder.ops)


def one(args, sessions: int, profile: bool) -> dict:
    b = Bench(sessions, args.turns, args.final_tokens, args.layers, args.device_frac, args.hicache_ratio, args.seed,
              args.prefill_us)
    prof = cProfile.Profile() if profile else None
    w0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    b.run()
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    ops = executor_ops(b.s)
    out = dict(sessions=sessions, turns=args.turns, layers=args.layers, final_tokens=args.final_tokens,
               working_set_tokens=b.working, device_tokens=b.device_tokens,
               host_tokens=int(b.s.host_pool.size), wall_s=round(wall, 2), cpu_s=round(cpu, 2),
               cache_ops_per_wall_s=round(b.counts["cache_ops"] / wall, 1),
               cache_ops_per_cpu_s=round(b.counts["cache_ops"] / cpu, 1),
               executor_ops=ops, executor_ops_per_wall_s=round(ops / wall, 1),
               executor_ops_per_cpu_s=round(ops / cpu, 1),
               peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
               sim_time_us=round(b.s.now, 1), profiled=profile, **b.counts)
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
        out["profile"] = buf.getvalue()
    return out


def machine() -> dict:
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in model.splitlines() if ln.startswith("Model name")), "?")
    import simpy
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return dict(cpu=name, nproc=nproc, python=platform.python_version(), numpy=np.__version__,
                simpy=simpy.__version__, date=time.strftime("%Y-%m-%d", time.gmtime()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[6, 20, 60])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--final-tokens", type=int, default=80_000)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--device-frac", type=float, default=0.25)
    ap.add_argument("--hicache-ratio", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-us", type=float, default=0.6,
                    help="simulated prefill compute per new token and layer, us (0.6: about 27k tokens/s "
                         "for 61 layers, a DeepSeek V3-class prefill on a node)")
    ap.add_argument("--profile-biggest", action="store_true", help="cProfile the largest size (a separate run)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args, args.one, args.profile)))
        return
    base = [sys.executable, __file__, "--turns", str(args.turns), "--final-tokens", str(args.final_tokens),
            "--layers", str(args.layers), "--device-frac", str(args.device_frac),
            "--hicache-ratio", str(args.hicache_ratio), "--seed", str(args.seed),
            "--prefill-us", str(args.prefill_us)]
    runs = [(n, False) for n in args.sessions]
    if args.profile_biggest:
        runs.append((max(args.sessions), True))
    info = machine()
    print(json.dumps(info))
    results = []
    for n, prof in runs:
        p = subprocess.run(base + ["--one", str(n)] + (["--profile"] if prof else []), capture_output=True,
                           text=True)
        if p.returncode:
            sys.stderr.write(p.stderr)
            raise SystemExit(f"size {n} failed")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results.append(r)
        text = r.pop("profile", None)
        print(json.dumps(r), flush=True)
        if text:
            print(text, flush=True)
            r["profile"] = text
    print()
    print("| sessions | requests | cache ops | wall s | CPU s | cache ops / wall s | cache ops / CPU s | "
          "executor ops | executor ops / wall s | load-backs (tokens) | backups | evict calls | "
          "simulated ms | peak RSS MiB |")
    print("|---:" * 14 + "|")
    for r in results:
        if r["profiled"]:
            continue
        print(f"| {r['sessions']} | {r['requests']} | {r['cache_ops']:,} | {r['wall_s']} | {r['cpu_s']} | "
              f"{r['cache_ops_per_wall_s']:,} | {r['cache_ops_per_cpu_s']:,} | {r['executor_ops']:,} | "
              f"{r['executor_ops_per_wall_s']:,} | {r['load_backs']:,} ({r['loaded_tokens']:,}) | "
              f"{r['backups']:,} | {r['evict_calls']:,} | {r['sim_time_us'] / 1000:,.1f} | {r['peak_rss_mib']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
