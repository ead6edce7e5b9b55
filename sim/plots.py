"""Plots of sweeps and timelines (matplotlib, imported inside the functions: ``import sim``
never needs it; install it with ``pip install 'kvrace[plot]'``).

* ``plot_sweep``: the corrupt fraction of each point against a swept size,
  with its 95 % Wilson interval as a band, one line per value of another
  parameter (compute time, say); every other parameter that varies in the
  results gets its own panel.  Fixed variants (``gated``) are plotted like any
  other line, so they show at zero.
* ``plot_timeline``: one run's timeline (``sim.trace.timeline``): a lane per
  host and stream, ops as bars, copies with the cumulative count of their
  items landed, reads marked clean / stale / torn / indeterminate, latent
  races marked, and record -> wait edges as arrows.

Both write ``BASE.png`` and ``BASE.svg`` and return the two paths.
"""
from __future__ import annotations

import itertools

from sim.errors import InputError, show

__all__ = ["STATUS_COLOURS", "plot_sweep", "plot_timeline", "sweep_layout"]

STATUS_COLOURS = {"clean": "#2ca02c", "stale": "#d62728", "torn": "#9467bd", "indeterminate": "#ff7f0e",
                  "race": "#000000"}
_OP_COLOURS = {"copy": "#1f77b4", "read": "#17becf", "write": "#bcbd22", "compute": "#c7c7c7",
               "record": "#8c564b", "wait": "#e377c2", "host_sync": "#e377c2", "host_delay": "#dddddd",
               "host_query": "#8c564b", "barrier": "#7f7f7f"}
#: columns of a sweep row that are results, never parameters
_RESULT_KEYS = {"key", "generator", "profile", "trials", "corrupt_trials", "stale_trials", "torn_trials",
                "indeterminate_trials", "corrupt_fraction", "ci_lo", "ci_hi", "latent_races", "stopped"}
MAX_PANELS = 24


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("plot", "matplotlib is not installed; expected `pip install 'kvrace[plot]'`") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, base: str) -> list[str]:
    paths = [f"{base}.png", f"{base}.svg"]
    for p in paths:
        fig.savefig(p, dpi=120)
    return paths


def plot_sweep(rows: list[dict], base: str, *, x: str | None = None, lines: str | None = None,
               title: str | None = None) -> list[str]:
    """Corrupt fraction against ``x`` (a parameter or derived column), one line
    per value of ``lines``, a panel per combination of the other varying
    columns; writes ``base.png`` and ``base.svg``."""
    if not rows:
        raise InputError("plot", "the sweep has no points to plot")
    x, lines, panel_keys = sweep_layout(rows, x, lines)
    panels = sorted({tuple(repr(r.get(k)) for k in panel_keys) for r in rows})
    if len(panels) > MAX_PANELS:
        raise InputError("plot", f"{len(panels)} panels (one per combination of {', '.join(panel_keys)}); "
                         f"expected at most {MAX_PANELS}: choose --x/--lines among them or plot fewer points")
    plt = _pyplot()
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(8.5, 6.2 * ncols), 4.4 * nrows + 0.4), squeeze=False)
    cmap = plt.get_cmap("viridis")
    line_values = sorted({r.get(lines) for r in rows}, key=_order) if lines else [None]
    for ax, panel in itertools.zip_longest(axes.flat, panels):
        if panel is None:
            ax.set_visible(False)
            continue
        sel = [r for r in rows if tuple(repr(r.get(k)) for k in panel_keys) == panel]
        for i, lv in enumerate(line_values):
            pts = sorted((r for r in sel if lines is None or r.get(lines) == lv), key=lambda r: _order(r[x]))
            if not pts:
                continue
            xs = [r[x] for r in pts]
            colour = cmap(i / max(1, len(line_values) - 1))
            ax.plot(xs, [r["corrupt_fraction"] for r in pts], marker="o", ms=4, color=colour,
                    label=f"{lines} = {lv}" if lines else None)
            ax.fill_between(xs, [r["ci_lo"] for r in pts], [r["ci_hi"] for r in pts], color=colour, alpha=0.2,
                            linewidth=0)
        numeric = all(isinstance(r[x], (int, float)) and not isinstance(r[x], bool) for r in sel)
        if numeric and min(r[x] for r in sel) > 0 and max(r[x] for r in sel) / min(r[x] for r in sel) >= 16:
            ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(x)
        ax.set_ylabel("corrupt fraction (95 % Wilson band)")
        if panel_keys:
            ax.set_title(", ".join(f"{k} = {v}" for k, v in zip(panel_keys, panel)), fontsize=9)
        if lines:
            ax.legend(fontsize=8, loc="best")
    r0 = rows[0]
    trials = sorted({r["trials"] for r in rows})
    fig.suptitle(title or f"{r0.get('generator', 'sweep')}: corrupt fraction against {x} "
                 f"(profile {r0.get('profile')}, {trials[0]}{'-' + str(trials[-1]) if len(trials) > 1 else ''} "
                 "trials per point)", fontsize=10)
    fig.tight_layout()
    try:
        return _save(fig, base)
    finally:
        plt.close(fig)


def sweep_layout(rows: list[dict], x: str | None = None, lines: str | None = None) -> tuple[str, str | None, list]:
    """The axes of a sweep plot: (x column, lines column or None, panel columns).

    Defaults: ``x`` the first varying column, ``lines`` the next one.  Panels
    are the other varying columns, except those that vary *with* ``x`` (a
    derived column such as ``load_bytes`` against the ``bytes_per_token`` it is
    made of: one value of x gives one value of it)."""
    if not rows:
        raise InputError("plot", "the sweep has no points to plot")
    columns = [k for k in rows[0] if k not in _RESULT_KEYS]
    varying = [k for k in columns if len({repr(r.get(k)) for r in rows}) > 1]
    for name, value in (("--x", x), ("--lines", lines)):
        if value is not None and value not in columns:
            raise InputError(name, f"expected a column of the sweep: {', '.join(columns)}; got {show(value)}")
    if x is None:
        x = next((k for k in varying if k != lines), columns[0])
    if lines is None:
        lines = next((k for k in varying if k != x and not _follows(rows, x, k)), None)
    if lines == x:
        raise InputError("--lines", f"expected a column other than --x ({x})")
    panel_keys = [k for k in varying if k not in (x, lines) and not _follows(rows, x, k)]
    return x, lines, panel_keys


def _follows(rows: list[dict], a: str, b: str) -> bool:
    """Does column ``b`` take one value for each value of ``a`` across the rows?"""
    pairs = {(repr(r.get(a)), repr(r.get(b))) for r in rows}
    return len(pairs) == len({p[0] for p in pairs})


def _order(v):
    """Sort key for mixed column values (numbers by value, then texts, None first)."""
    if v is None:
        return (0, 0, "")
    if isinstance(v, (int, float)):
        return (1, float(v), "")
    return (2, 0, str(v))


def plot_timeline(tl, base: str, *, title: str | None = None) -> list[str]:
    """Draw ``tl`` (a ``sim.trace.Timeline``); writes ``base.png`` and ``base.svg``."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lane_y = {lane: i for i, lane in enumerate(reversed(tl.lanes))}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(tl.lanes)))
    span = max(tl.end_us, 1e-9)
    tick = span / 400                      # zero-length ops are drawn as this wide a tick
    for sl in tl.slices:
        y = lane_y[sl.lane]
        w = sl.end_us - sl.start_us
        ax.broken_barh([(sl.start_us, max(w, tick))], (y - 0.3, 0.6), facecolors=_OP_COLOURS.get(sl.kind, "#999"),
                       edgecolors="black", linewidth=0.4)
        if w > span / 12:
            ax.text(sl.start_us + w / 2, y, sl.op, ha="center", va="center", fontsize=7, clip_on=True)
    for ld in tl.landings:
        y = lane_y[ld.lane]
        ax.step(ld.times_us, y - 0.3 + 0.6 * ld.counts / max(1, ld.items), where="post", color="white",
                linewidth=1.2)
        ax.plot(ld.times_us, [y - 0.38] * ld.times_us.size, "|", color="#1f77b4", ms=5)
    for m in tl.marks:
        y = lane_y[m.lane]
        marker = "x" if m.kind == "race" else "v"
        ax.plot([m.time_us], [y + (0.45 if m.kind == "race" else 0.38)], marker=marker, ms=9,
                color=STATUS_COLOURS.get(m.kind, "black"), markeredgewidth=2)
    for e in tl.edges:
        ax.annotate("", xy=(e.dst_us, lane_y[e.dst_lane]), xytext=(e.src_us, lane_y[e.src_lane]),
                    arrowprops={"arrowstyle": "->", "color": "#e377c2", "lw": 1.2,
                                "connectionstyle": "arc3,rad=0.15"})
    ax.set_yticks(list(lane_y.values()), [lane.replace(":", " ") for lane in lane_y])
    ax.set_xlabel("simulated time (us)")
    ax.set_xlim(-span * 0.02, span * 1.04)
    ax.grid(True, axis="x", alpha=0.3)
    kinds = sorted({sl.kind for sl in tl.slices})
    handles = [Patch(facecolor=_OP_COLOURS.get(k, "#999"), edgecolor="black", label=k) for k in kinds]
    handles += [Line2D([], [], marker="v", ls="", color=STATUS_COLOURS[k], label=f"{k} read")
                for k in ("clean", "stale", "torn", "indeterminate") if any(m.kind == k for m in tl.marks)]
    if any(m.kind == "race" for m in tl.marks):
        handles.append(Line2D([], [], marker="x", ls="", color="black", label="latent race"))
    if tl.edges:
        handles.append(Line2D([], [], color="#e377c2", label="record -> wait"))
    if tl.landings:
        handles.append(Line2D([], [], marker="|", ls="", color="#1f77b4", label="items landed"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or f"{tl.name} (profile {tl.profile})")
    fig.tight_layout()
    try:
        return _save(fig, base)
    finally:
        plt.close(fig)
