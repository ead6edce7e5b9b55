"""A sweep's results on disk: ``sweep.json`` (the record) and ``sweep.csv``.

Both are written as points finish: the CSV gets one appended row per point,
the JSON is rewritten whole through a temporary file and ``os.replace`` (a
crash leaves the previous complete file).  ``sweep.json`` is the record a
re-run resumes from: the points whose key it holds are skipped; the CSV is
rewritten from it when the store opens (so a row cut by a crash is dropped).
A re-run must have the same settings (``meta``): other settings would give
other numbers for the same keys, so they are refused, naming the setting.
"""
from __future__ import annotations

import csv
import json
import os

from sim.errors import InputError, show

__all__ = ["CSV_NAME", "JSON_NAME", "SweepStore", "load_results"]

JSON_NAME, CSV_NAME = "sweep.json", "sweep.csv"
FORMAT = 1


def load_results(path: str) -> dict:
    """A ``sweep.json`` document (``path`` is the file or its folder)."""
    if os.path.isdir(path):
        path = os.path.join(path, JSON_NAME)
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise InputError(path, "no such file; expected a sweep.json written by `kvrace sweep --out DIR` "
                         "(or its folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"cannot read it as JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kvrace_sweep") != FORMAT or not isinstance(doc.get("points"), list):
        raise InputError(path, f"expected a kvrace sweep document (kvrace_sweep: {FORMAT}, points: [...]), got "
                         f"{show(doc if not isinstance(doc, dict) else sorted(doc))}")
    return doc


class SweepStore:
    """The results folder of one sweep (see the module doc).  ``columns`` fixes
    the CSV header; ``done`` maps point keys to their rows."""

    def __init__(self, out_dir: str, meta: dict, columns: list[str]):
        self.dir = out_dir
        self.meta = meta
        self.columns = columns
        self.json_path = os.path.join(out_dir, JSON_NAME)
        self.csv_path = os.path.join(out_dir, CSV_NAME)
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise InputError("--out", f"cannot create folder {out_dir!r}: {e.strerror}") from None
        self.rows: list[dict] = []
        self.runs: list[dict] = []
        if os.path.exists(self.json_path):
            doc = load_results(self.json_path)
            old = doc.get("meta", {})
            for k, v in meta.items():
                if old.get(k) != v:
                    raise InputError(f"--out {out_dir}", f"{self.json_path} holds a sweep with {k}={show(old.get(k))}, "
                                     f"this one has {k}={show(v)}; expected the same settings to resume "
                                     "(use another --out folder, or delete the file to start again)")
            self.rows = [r for r in doc["points"] if isinstance(r, dict) and "key" in r]
            self.runs = list(doc.get("runs", []))
        self.done = {r["key"]: r for r in self.rows}
        self._write_csv_all()
        self._write_json()

    def add(self, row: dict) -> None:
        """Record one finished point (appends the CSV row, rewrites the JSON)."""
        self.rows.append(row)
        self.done[row["key"]] = row
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore").writerow(_csv_row(row))
        self._write_json()

    def finish_run(self, info: dict) -> None:
        """Append one run's summary (wall time, workers, backend, points run) to the record."""
        self.runs.append(info)
        self._write_json()

    def _write_csv_all(self) -> None:
        tmp = self.csv_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            w.writeheader()
            for r in self.rows:
                w.writerow(_csv_row(r))
        os.replace(tmp, self.csv_path)

    def _write_json(self) -> None:
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"kvrace_sweep": FORMAT, "meta": self.meta, "runs": self.runs, "points": self.rows}, f,
                      indent=1)
            f.write("\n")
        os.replace(tmp, self.json_path)


def _csv_row(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, float):
            out[k] = f"{v:.6g}"
        elif v is None:
            out[k] = ""
        else:
            out[k] = v
    return out
