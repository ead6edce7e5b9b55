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
* ``signature_heatmap``: the incident's signature table (``kvrace signatures
  --json``; checked by ``check_signature_table``): hypotheses against A/B
  configurations, each cell coloured by its corrupted fraction and annotated
  with it and its interval, rows that fit the observations marked, and the
  deployment's observed row on top.

Each writes ``BASE.png`` and ``BASE.svg`` and returns the paths
(``signature_heatmap`` writes only one file when its path ends in ``.png`` or ``.svg``).
"""
from __future__ import annotations

import itertools

from sim.errors import InputError, check_keys, show

__all__ = ["STATUS_COLOURS", "check_signature_table", "plot_sweep", "plot_timeline", "signature_heatmap",
           "sweep_layout"]

STATUS_COLOURS = {"clean": "#2ca02c", "stale": "#d62728", "torn": "#9467bd", "indeterminate": "#ff7f0e",
                  "race": "#000000", "mismatch": "#e6007e"}
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
    ax.set_xlabel(f"{tl.clock} time (us)")
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


# ---------------------------------------------------------------- the signature table

_TABLE_KEYS = ("scenario", "trials", "columns", "rows", "observed")
_CELL_KEYS = ("corrupted", "requests", "fraction", "ci")
_FITS_COLOUR, _MISFIT_COLOUR, _NA_COLOUR = "#1a7f37", "#555555", "#d9d9d9"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _fraction(v, where: str) -> float:
    if not _is_number(v) or not 0 <= v <= 1:
        raise InputError(where, f"expected a fraction in [0, 1], got {show(v)}")
    return float(v)


def check_signature_table(table) -> dict:
    """Check ``table`` (the JSON of ``kvrace signatures --json``) and return it.

    The shape: ``{"scenario": str, "trials": int, "columns": [{"name": str,
    "config": {...}}], "rows": [{"hypothesis": str, "cells": [{"corrupted": int,
    "requests": int, "fraction": float, "ci": [lo, hi]}], "score": float, "fits":
    bool}], "observed": [{"fraction": float | null, "corrupt": bool | null}]}``:
    one cell per column in every row, one observed entry per column (``corrupt``
    null: not observed), ``lo <= fraction <= hi`` inside [0, 1] and ``corrupted
    <= requests``.  Other keys are allowed (``kvrace signatures --json`` adds the
    matrix, seed, per-row ``matched`` and per-cell read counts) and ignored, but
    a row's ``matched``, when present, must hold one true/false/null per column.
    Every error names the key (``signatures.rows[2].cells[0].ci``) and what it
    expects."""
    w = "signatures"
    if not isinstance(table, dict):
        raise InputError(w, f"expected a JSON object with keys {list(_TABLE_KEYS)}, got {show(table)}")
    # NOTE: only the keys the heat map draws are required; the producer's other keys pass
    check_keys(table, set(table) | set(_TABLE_KEYS), w, required=_TABLE_KEYS, context=" (a signature table)")
    if not isinstance(table["scenario"], str):
        raise InputError(f"{w}.scenario", f"expected a text, got {show(table['scenario'])}")
    if not isinstance(table["trials"], int) or isinstance(table["trials"], bool) or table["trials"] < 1:
        raise InputError(f"{w}.trials", f"expected a whole number >= 1, got {show(table['trials'])}")
    cols = table["columns"]
    if not isinstance(cols, list) or not cols:
        raise InputError(f"{w}.columns", f"expected a non-empty list of {{name, config}}, got {show(cols)}")
    for i, c in enumerate(cols):
        where = f"{w}.columns[{i}]"
        if not isinstance(c, dict):
            raise InputError(where, f"expected an object {{name, config}}, got {show(c)}")
        check_keys(c, set(c) | {"name", "config"}, where, required=("name", "config"), context=" (a column)")
        if not isinstance(c["name"], str):
            raise InputError(f"{where}.name", f"expected a text, got {show(c['name'])}")
        if not isinstance(c["config"], dict):
            raise InputError(f"{where}.config", f"expected an object of configuration keys, got {show(c['config'])}")
    rows = table["rows"]
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{w}.rows", f"expected a non-empty list of hypothesis rows, got {show(rows)}")
    for i, r in enumerate(rows):
        where = f"{w}.rows[{i}]"
        if not isinstance(r, dict):
            raise InputError(where, f"expected an object {{hypothesis, cells, score, fits}}, got {show(r)}")
        check_keys(r, set(r) | {"hypothesis", "cells", "score", "fits"}, where,
                   required=("hypothesis", "cells", "score", "fits"), context=" (a hypothesis row)")
        matched = r.get("matched")
        if matched is not None and not (isinstance(matched, list) and len(matched) == len(cols)
                                        and all(m in (True, False, None) for m in matched)):
            raise InputError(f"{where}.matched", f"expected a list of {len(cols)} true/false/null (one per "
                             f"column), got {show(matched)}")
        if not isinstance(r["hypothesis"], str):
            raise InputError(f"{where}.hypothesis", f"expected a text, got {show(r['hypothesis'])}")
        if not _is_number(r["score"]):
            raise InputError(f"{where}.score", f"expected a finite number, got {show(r['score'])}")
        if not isinstance(r["fits"], bool):
            raise InputError(f"{where}.fits", f"expected true or false, got {show(r['fits'])}")
        cells = r["cells"]
        if not isinstance(cells, list) or len(cells) != len(cols):
            raise InputError(f"{where}.cells", f"expected a list of {len(cols)} cells (one per column), got "
                             f"{show(cells)}")
        for j, cell in enumerate(cells):
            cw = f"{where}.cells[{j}]"
            if not isinstance(cell, dict):
                raise InputError(cw, f"expected an object {{{', '.join(_CELL_KEYS)}}}, got {show(cell)}")
            check_keys(cell, set(cell) | set(_CELL_KEYS), cw, required=_CELL_KEYS, context=" (a cell)")
            n, k = cell["requests"], cell["corrupted"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InputError(f"{cw}.requests", f"expected a whole number >= 0, got {show(n)}")
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= n:
                raise InputError(f"{cw}.corrupted", f"expected a whole number in [0, requests={n}], got {show(k)}")
            f = _fraction(cell["fraction"], f"{cw}.fraction")
            ci = cell["ci"]
            if not (isinstance(ci, list) and len(ci) == 2):
                raise InputError(f"{cw}.ci", f"expected [lo, hi], got {show(ci)}")
            lo, hi = (_fraction(v, f"{cw}.ci") for v in ci)
            # NOTE: a small tolerance: the producer rounds the fraction and its bounds separately
            if not lo - 1e-9 <= f <= hi + 1e-9:
                raise InputError(f"{cw}.ci", f"expected lo <= fraction <= hi, got ci {show(ci)} around {f:g}")
    obs = table["observed"]
    if not isinstance(obs, list) or len(obs) != len(cols):
        raise InputError(f"{w}.observed", f"expected a list of {len(cols)} entries (one per column), got {show(obs)}")
    for j, o in enumerate(obs):
        ow = f"{w}.observed[{j}]"
        if not isinstance(o, dict):
            raise InputError(ow, f"expected an object {{fraction, corrupt}}, got {show(o)}")
        check_keys(o, set(o) | {"fraction", "corrupt"}, ow, required=("fraction", "corrupt"),
                   context=" (an observation)")
        if o["fraction"] is not None:
            _fraction(o["fraction"], f"{ow}.fraction")
        if o["corrupt"] not in (True, False, None):
            raise InputError(f"{ow}.corrupt", f"expected true, false or null (not observed), got {show(o['corrupt'])}")
    return table


def _config_text(config: dict, limit: int = 3) -> str:
    items = [f"{str(k).rsplit('.', 1)[-1]}={v}" for k, v in config.items()]     # model.index_k_dtype -> index_k_dtype
    return "\n".join(items[:limit] + ([f"+{len(items) - limit} more"] if len(items) > limit else []))


def _cell_colour_text(cmap, value: float) -> str:
    r, g, b, _ = cmap(value)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def signature_heatmap(table: dict, path: str, *, title: str | None = None) -> list[str]:
    """Draw the signature table as a heat map; returns the files written.

    One row per hypothesis, one column per A/B configuration.  A cell's colour
    is its corrupted fraction (0 white to 1 dark red; no requests: grey, "n/a");
    its text is the fraction, the 95 % interval and ``corrupted/requests``.
    Rows that fit the observations carry a check mark and a green frame; each
    row's score is written at its right; where a row says per column whether it
    matched the observation (``matched``), the cell's corner shows a check or a
    cross.  The top row, set apart, is what the deployment observed per column:
    the fraction (and its range, when ``low``/``high`` are given) when known,
    otherwise "corrupt" or "clean" (coloured 1 or 0), or "not observed" (grey).

    ``path``: ``X.png`` or ``X.svg`` writes that file; any other path is a base
    and writes ``path.png`` and ``path.svg``."""
    check_signature_table(table)
    plt = _pyplot()
    import numpy as np
    from matplotlib.patches import Rectangle

    cols, rows, obs = table["columns"], table["rows"], table["observed"]
    nc, nr = len(cols), len(rows)
    cmap = plt.get_cmap("Reds")
    cell_w, cell_h = 1.55, 0.72
    fig_w = 3.2 + cell_w * nc + 1.1
    fig_h = 1.6 + cell_h * (nr + 1) + 0.55
    fig, (ax_obs, ax) = plt.subplots(2, 1, figsize=(fig_w, fig_h), sharex=True,
                                     gridspec_kw={"height_ratios": [1, nr], "hspace": 0.08})
    grid = np.array([[c["fraction"] if c["requests"] else np.nan for c in r["cells"]] for r in rows], float)
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i, r in enumerate(rows):
        for j, c in enumerate(r["cells"]):
            if not c["requests"]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=_NA_COLOUR, edgecolor="none"))
                ax.text(j, i, "n/a\n(no requests)", ha="center", va="center", fontsize=7, color="black")
                continue
            lo, hi = c["ci"]
            ax.text(j, i, f"{c['fraction']:.2f}\n[{lo:.2f}, {hi:.2f}]\n{c['corrupted']}/{c['requests']}",
                    ha="center", va="center", fontsize=7, color=_cell_colour_text(cmap, c["fraction"]))
        for j, m in enumerate(r.get("matched") or ()):
            if m is not None:
                ax.text(j + 0.45, i - 0.42, "\u2713" if m else "\u2717", ha="right", va="top", fontsize=8,
                        color=_FITS_COLOUR if m else "#b00020", fontweight="bold")
        if r["fits"]:
            ax.add_patch(Rectangle((-0.5 + 0.02, i - 0.5 + 0.03), nc - 0.04, 0.94, fill=False, edgecolor=_FITS_COLOUR,
                                   linewidth=3, zorder=5))
        ax.text(nc - 0.5 + 0.08, i, f"score\n{r['score']:.3g}", ha="left", va="center", fontsize=7,
                color=_FITS_COLOUR if r["fits"] else _MISFIT_COLOUR, clip_on=False)
    ax.set_yticks(range(nr), [("\u2713 " if r["fits"] else "") + r["hypothesis"] for r in rows], fontsize=8)
    for label, r in zip(ax.get_yticklabels(), rows):
        if r["fits"]:
            label.set_color(_FITS_COLOUR)
            label.set_fontweight("bold")
    ax.set_xticks(range(nc), [f"{c['name']}\n{_config_text(c['config'])}" for c in cols], fontsize=7)
    ax.set_xticks(np.arange(-0.5, nc, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nr, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)

    shown = np.array([[o["fraction"] if o["fraction"] is not None else
                        np.nan if o["corrupt"] is None else float(o["corrupt"]) for o in obs]], float)
    ax_obs.imshow(np.ma.masked_invalid(shown), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for j, o in enumerate(obs):
        if o["fraction"] is not None:
            text = f"{o['fraction']:.2f}"
            if _is_number(o.get("low")) and _is_number(o.get("high")) and o["low"] < o["high"]:
                text += f"\n({o['low']:.2f}-{o['high']:.2f})"
        elif o["corrupt"] is None:
            ax_obs.add_patch(Rectangle((j - 0.5, -0.5), 1, 1, facecolor=_NA_COLOUR, edgecolor="none"))
            text = "not observed"
        else:
            text = "corrupt" if o["corrupt"] else "clean"
        ax_obs.text(j, 0, text, ha="center", va="center", fontsize=8, fontweight="bold",
                    color="black" if np.isnan(shown[0, j]) else _cell_colour_text(cmap, shown[0, j]))
    ax_obs.set_yticks([0], ["observed"], fontsize=8, fontweight="bold")
    ax_obs.set_xticks(np.arange(-0.5, nc, 1), minor=True)
    ax_obs.grid(which="minor", axis="x", color="white", linewidth=1.5)
    ax_obs.tick_params(which="both", length=0, labelbottom=False)
    for spine in ax_obs.spines.values():
        spine.set_edgecolor("black")
        spine.set_linewidth(1.2)
    fits = sum(r["fits"] for r in rows)
    fig.suptitle(title or f"{table['scenario']}: corrupted fraction per hypothesis and configuration "
                 f"({table['trials']} trials; {fits} of {nr} hypotheses fit: \u2713, green frame)", fontsize=9)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=[ax_obs, ax], fraction=0.03, pad=0.09, label="corrupted fraction")
    try:
        if path.endswith((".png", ".svg")):
            fig.savefig(path, dpi=120, bbox_inches="tight")
            return [path]
        paths = [f"{path}.png", f"{path}.svg"]
        for p in paths:
            fig.savefig(p, dpi=120, bbox_inches="tight")
        return paths
    finally:
        plt.close(fig)
