"""Free replay of the minimal race over index-K row sizes and load sizes: measured vs predicted.

The schedule family (made here, one per point): HiCache loads one layer of index-K for ``tokens``
tokens from the pinned host pool (request 12's rows, host units 0..tokens-1) into device slots
``tokens..2*tokens-1`` (which hold the previous owner's rows) on the ``load`` stream, with the
token-row kernel copy (``kernel_per_layer``, one item per token); the ``forward`` stream runs a
``compute`` op of ``compute_us`` and then reads the loaded rows WITHOUT waiting for the load's
event.  Row sizes: 64, 128, 136 (the 132 B DSA index-K row rounded up to a multiple of 8, which
the warp copy needs), 256, 512 and 1024 B per token; loads of 64, 256, 1,024 and 4,096 tokens.

For every point: the measured stale fraction over ``--trials`` free replays on the GPU (95 %
Wilson interval; every observed word must be plausible), and the simulator's predicted stale
fraction with the same profile: the fraction of ``--sim-seeds`` seeded runs (compute jitter,
seeded ties) whose read is stale.  Simulator runs go first, on a process pool, before CUDA starts.

    python3 benchmarks/free_sweep.py --out DIR [--profile PATH] [--trials N] [--provider builtin] [--timed K]
    python3 benchmarks/free_sweep.py --out DIR --measure-only ...     # GPU side only
    python3 benchmarks/free_sweep.py --out DIR --predict DIR/free_sweep.csv --profile PATH   # no GPU
    python3 benchmarks/free_sweep.py --out DIR --plot-only DIR/free_sweep.csv

``--timed K`` adds K runs with CUDA events after each point's trials (medians of the copy's start
and end, its duration quantiles; the link refit of gpu_backend.calibrate.spread_fit reads them).
The command and commit go to ``free_sweep.csv.provenance.txt`` beside the CSV (``KVRACE_COMMIT``
where the tree has no .git).  The agreement table over these CSVs: ``benchmarks/agreement.py``.

Writes DIR/free_sweep.csv and DIR/free_sweep.png (matplotlib; measured and predicted side by
side, log-x over the bytes loaded).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BYTES_PER_TOKEN = (64, 128, 136, 256, 512, 1024)
TOKENS = (64, 256, 1024, 4096)
COMPUTE_US = (3.0, 10.0, 30.0)
FIELDS = ["compute_us", "bytes_per_token", "tokens", "load_bytes", "provider", "device", "trials",
          "stale_trials", "measured_stale", "measured_lo", "measured_hi", "implausible_words",
          "sim_seeds", "sim_stale_runs", "predicted_stale", "predicted_lo", "predicted_hi",
          "gpu_copy_start_us", "gpu_copy_end_us", "gpu_read_start_us", "sim_copy_end_us", "sim_read_us",
          "timed_runs", "gpu_copy_us_p10", "gpu_copy_us_p50", "gpu_copy_us_p90"]
MEASURED = FIELDS[:12] + ["gpu_copy_start_us", "gpu_copy_end_us", "gpu_read_start_us", "timed_runs",
                          "gpu_copy_us_p10", "gpu_copy_us_p50", "gpu_copy_us_p90"]


def sweep_doc(bytes_per_token: int, tokens: int, compute_us: float) -> dict:
    """The minimal ungated race at one point of the sweep (``gpu_backend.calibrate.spread.race_doc``,
    the schedule the calibration's race-window scans use too)."""
    from gpu_backend.calibrate.spread import race_doc

    return race_doc(bytes_per_token, tokens, compute_us)


def _predict(job):
    """Simulator side of one point (runs in a worker process)."""
    from gpu_backend.compare import wilson_interval
    from gpu_backend.replay import simulate_stale
    from sim.executor import run_schedule
    from sim.profile import load_profile
    from sim.schedule import validate

    key, profile_name, seeds = job
    b, t, c = key
    prof = load_profile(profile_name)
    s = validate(sweep_doc(b, t, c))
    per_read, _ = simulate_stale(s, prof, seeds=seeds, seed=0)
    k = per_read["indexer_read_index_k_L0"]
    lo, hi = wilson_interval(k, seeds)
    run = run_schedule(s, prof, seed=0, materialise=False)
    return key, {"sim_seeds": seeds, "sim_stale_runs": k, "predicted_stale": k / seeds,
                 "predicted_lo": lo, "predicted_hi": hi,
                 "sim_copy_end_us": float(run.item_end_us["load_index_k_L0"][-1]),
                 "sim_read_us": float(run.access_us["indexer_read_index_k_L0"])}


def predict_all(points, profile_name: str, seeds: int, workers: int) -> dict:
    jobs = [(p, profile_name, seeds) for p in points]
    if workers <= 1:
        return dict(map(_predict, jobs))
    import multiprocessing as mp

    ctx = mp.get_context("fork")      # before CUDA is initialised in this process
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return dict(pool.map(_predict, jobs))


def measure(point, provider, profile_name: str, trials: int, timed: int = 1) -> dict:
    """The GPU side of one point: ``trials`` untimed free replays (the stale fraction), then
    ``timed`` runs with CUDA events around every op (medians of the copy's start and end and of
    the read's start after the gate; the copy's duration quantiles).  The timed runs come after
    the trials and never count in the stale fraction: events between ops move the kernels."""
    from gpu_backend.replay import replay
    from gpu_backend.runner import GpuSchedule
    from sim.schedule import validate

    b, t, c = point
    s = validate(sweep_doc(b, t, c))
    made = {}

    def make_runner(schedule, prov, *, guard_bytes=None):
        made["runner"] = GpuSchedule(schedule, prov, guard_bytes=guard_bytes)
        return made["runner"]

    rep = replay(s, provider, "free", profile=profile_name, trials=trials, sim_seeds=0, make_runner=make_runner)
    import numpy as np

    runs = [made["runner"].run(timings=True, final=False, guards=False) for _ in range(max(1, timed))]
    r = rep["reads"][0]
    copy_t = np.array([run.timings_us["load_index_k_L0"] for run in runs])
    read_t = np.array([run.timings_us["indexer_read_index_k_L0"] for run in runs])
    cs, ce = (float(np.median(copy_t[:, i])) for i in (0, 1))
    rs = float(np.median(read_t[:, 0]))
    dur = copy_t[:, 1] - copy_t[:, 0]
    return {"timed_runs": len(runs), "gpu_copy_us_p10": float(np.quantile(dur, 0.1)),
            "gpu_copy_us_p50": float(np.median(dur)), "gpu_copy_us_p90": float(np.quantile(dur, 0.9)),"provider": rep["provider"], "device": rep["device"], "trials": trials,
            "stale_trials": r["stale_trials"], "measured_stale": r["stale_fraction"],
            "measured_lo": r["stale_ci95"][0], "measured_hi": r["stale_ci95"][1],
            "implausible_words": r["implausible_words"],
            "gpu_copy_start_us": cs, "gpu_copy_end_us": ce, "gpu_read_start_us": rs}


def _provenance() -> dict:
    """The command and commit (``KVRACE_COMMIT`` where the tree has no .git, e.g. a device copy)."""
    from benchmarks.provenance import command, git_commit

    commit = os.environ.get("KVRACE_COMMIT") or git_commit()
    return {"command": command(), "commit": commit}


def write_csv(path: str, rows: list[dict], provenance: dict | None = None) -> None:
    """The rows (a value not measured is ``nan``, so every column but provider and device parses as
    a float), and ``provenance`` (command, commit) as ``# key: value`` lines in ``PATH.provenance.txt``
    beside it: the CSV itself stays plain for readers such as notebooks/race_probability.ipynb."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for row in rows:
            out = {}
            for k in FIELDS:
                v = row.get(k, "")
                out[k] = f"{v:.6g}" if isinstance(v, float) else ("nan" if v in ("", None) else v)
            w.writerow(out)
    if provenance:
        with open(path + ".provenance.txt", "w") as f:
            for k, v in provenance.items():
                f.write(f"# {k}: {v}\n")


def read_csv(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for row in rows:
        for k, v in row.items():
            if k in ("provider", "device") or v in ("", None):
                continue
            row[k] = float(v)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    computes = sorted({float(r["compute_us"]) for r in rows})
    sizes = sorted({int(r["bytes_per_token"]) for r in rows})
    fig, axes = plt.subplots(len(computes), 2, figsize=(12, 4.2 * len(computes)), squeeze=False,
                             sharex=True, sharey=True)
    cmap = plt.get_cmap("viridis")
    for i, c in enumerate(computes):
        for j, (what, lo, hi, title) in enumerate((
                ("measured_stale", "measured_lo", "measured_hi", "measured on the GPU"),
                ("predicted_stale", "predicted_lo", "predicted_hi", "predicted by the simulator"))):
            ax = axes[i][j]
            for k, b in enumerate(sizes):
                pts = sorted((r for r in rows if float(r["compute_us"]) == c and int(r["bytes_per_token"]) == b),
                             key=lambda r: r["load_bytes"])
                if not pts:
                    continue
                x = [p["load_bytes"] for p in pts]
                y = [p[what] for p in pts]
                err = [[max(0.0, p[what] - p[lo]) for p in pts], [max(0.0, p[hi] - p[what]) for p in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3,
                            color=cmap(k / max(1, len(sizes) - 1)), label=f"{b} B/token")
            ax.set_xscale("log")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{title}: compute {c:g} us before the ungated read")
            if i == len(computes) - 1:
                ax.set_xlabel("bytes loaded (tokens x bytes per token)")
            if j == 0:
                ax.set_ylabel("stale fraction (95 % interval)")
    axes[0][0].legend(fontsize=8, loc="best")
    dev = rows[0].get("device", "") if rows else ""
    prov = rows[0].get("provider", "") if rows else ""
    fig.suptitle(f"Free replay of the ungated index-K read: {dev}, provider {prov}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (free_sweep.csv, free_sweep.png)")
    ap.add_argument("--profile", default="h200", help="hardware profile for the prediction (name or TOML path)")
    ap.add_argument("--trials", type=int, default=100, help="free replays per point (default 100)")
    ap.add_argument("--sim-seeds", type=int, default=40, help="simulator runs per point (default 40)")
    ap.add_argument("--provider", default="builtin", choices=["builtin", "torch", "sglang"])
    ap.add_argument("--bytes", default=",".join(map(str, BYTES_PER_TOKEN)), help="bytes per token, comma-separated")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens loaded, comma-separated")
    ap.add_argument("--compute-us", default=",".join(f"{c:g}" for c in COMPUTE_US),
                    help="compute op before the read, microseconds, comma-separated")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--plot-only", metavar="CSV", help="only draw the PNG from an existing CSV")
    ap.add_argument("--timed", type=int, default=1, help="timed runs per point after the trials (default 1)")
    ap.add_argument("--measure-only", action="store_true",
                    help="GPU side only: no prediction (the predicted columns stay empty; fill them with --predict)")
    ap.add_argument("--predict", metavar="CSV",
                    help="no GPU: keep the measured columns of CSV, predict every point with --profile")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "free_sweep.png")
    if args.plot_only:
        plot(read_csv(args.plot_only), png)
        print(f"wrote {png}")
        return 0
    if args.predict:
        rows = read_csv(args.predict)
        points = [(int(r["bytes_per_token"]), int(r["tokens"]), float(r["compute_us"])) for r in rows]
        t0 = time.perf_counter()
        predicted = predict_all(points, args.profile, args.sim_seeds, args.workers)
        rows = [{**{k: r.get(k, "") for k in MEASURED}, **predicted[p]} for r, p in zip(rows, points)]
        for r in rows:
            for k in ("bytes_per_token", "tokens", "trials", "stale_trials", "implausible_words", "timed_runs"):
                if r.get(k, "") != "":
                    r[k] = int(r[k])
        csv_path = os.path.join(args.out, "free_sweep.csv")
        side = args.predict + ".provenance.txt"
        measured_by = []
        if os.path.exists(side):
            with open(side) as f:
                measured_by = [line.strip()[2:] for line in f if line.startswith("# ")]
        write_csv(csv_path, rows, {"command": _provenance()["command"], "commit": _provenance()["commit"],
                                   "measured columns from": "; ".join(measured_by) or args.predict})
        print(f"predicted {len(points)} points x {args.sim_seeds} seeds in {time.perf_counter() - t0:.1f} s; "
              f"wrote {csv_path}")
        try:
            plot(rows, png)
            print(f"wrote {png}")
        except ImportError as e:
            print(f"no plot ({e})")
        return 0

    points = [(int(b), int(t), float(c)) for c in args.compute_us.split(",") for b in args.bytes.split(",")
              for t in args.tokens.split(",")]
    t0 = time.perf_counter()
    empty = {"sim_seeds": "", "sim_stale_runs": "", "predicted_stale": float("nan"), "predicted_lo": float("nan"),
             "predicted_hi": float("nan"), "sim_copy_end_us": float("nan"), "sim_read_us": float("nan")}
    predicted = ({p: empty for p in points} if args.measure_only
                 else predict_all(points, args.profile, args.sim_seeds, args.workers))
    print(f"simulator: {len(points)} points x {args.sim_seeds} seeds in {time.perf_counter() - t0:.1f} s",
          flush=True)
    from gpu_backend.providers import get_provider

    provider = get_provider(args.provider)        # one instance: its kernels are built once
    rows = []
    for p in points:
        t1 = time.perf_counter()
        m = measure(p, provider, args.profile, args.trials, args.timed)
        row = {"compute_us": p[2], "bytes_per_token": p[0], "tokens": p[1], "load_bytes": p[0] * p[1],
               **m, **predicted[p]}
        rows.append(row)
        print(f"compute {p[2]:g} us, {p[0]:5d} B x {p[1]:5d} tokens: measured {row['measured_stale']:.3f} "
              f"[{row['measured_lo']:.3f}, {row['measured_hi']:.3f}]  predicted {row['predicted_stale']:.3f}  "
              f"implausible {row['implausible_words']}  (GPU copy {row['gpu_copy_start_us']:.1f}-"
              f"{row['gpu_copy_end_us']:.1f} us, read at {row['gpu_read_start_us']:.1f} us; simulated copy end "
              f"{row['sim_copy_end_us']:.1f} us, read {row['sim_read_us']:.1f} us)  {time.perf_counter() - t1:.1f} s",
              flush=True)
    csv_path = os.path.join(args.out, "free_sweep.csv")
    write_csv(csv_path, rows, _provenance())
    print(f"wrote {csv_path}")
    if args.measure_only:
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0 if all(r["implausible_words"] == 0 for r in rows) else 1
    try:
        plot(rows, png)
        print(f"wrote {png}")
    except ImportError as e:
        print(f"no plot ({e}); run again with --plot-only {csv_path} where matplotlib is installed")
    print(f"total {time.perf_counter() - t0:.1f} s; implausible words {sum(r['implausible_words'] for r in rows)}")
    return 0 if all(r["implausible_words"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
