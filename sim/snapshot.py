"""Snapshot: what a run of a schedule saw — the other half of the central contract.

For every ``read``, the bytes it saw; for every buffer, a digest of its final
bytes (``Memory.digest``: sha256 of the bytes, or of the provenance for buffers
over ``BYTE_DIGEST_LIMIT``; a GPU run hashes bytes, so ``first_difference``
skips buffers whose two digests are of different kinds); plus timings where
measured.  The simulator produces predicted
snapshots (``snapshot_of(run)``), the GPU backend observed ones; both serialise
to the same versioned JSON (read bytes as base64) and compare with
``first_difference``.
"""
from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from sim.errors import InputError, require

SNAPSHOT_VERSION = 1


@dataclass
class Snapshot:
    schedule_digest: str
    source: str                                  # "simulated:<profile>", "reference", "gpu:<provider>"
    reads: dict[str, np.ndarray]                 # read op id -> bytes seen (uint8)
    buffers: dict[str, str]                      # buffer name -> sha256 of its final bytes
    timings_us: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kvrace_snapshot": SNAPSHOT_VERSION, "schedule_digest": self.schedule_digest,
                "source": self.source,
                "reads": {k: base64.b64encode(v.tobytes()).decode() for k, v in self.reads.items()},
                "buffers": dict(self.buffers), "timings_us": self.timings_us}

    @classmethod
    def from_json(cls, doc) -> "Snapshot":
        require(isinstance(doc, dict) and doc.get("kvrace_snapshot") == SNAPSHOT_VERSION, "kvrace_snapshot",
                f"expected a kvrace snapshot of version {SNAPSHOT_VERSION}")
        for key in ("schedule_digest", "source", "reads", "buffers"):
            require(key in doc, key, "missing")
        try:
            reads = {k: np.frombuffer(base64.b64decode(v, validate=True), np.uint8).copy()
                     for k, v in doc["reads"].items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise InputError("reads", f"expected base64 strings per read op id ({e})") from None
        return cls(doc["schedule_digest"], doc["source"], reads, dict(doc["buffers"]),
                   dict(doc.get("timings_us", {})))

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str) -> "Snapshot":
        with open(path) as f:
            return cls.from_json(json.load(f))


def digest(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def snapshot_of(run, source: str | None = None) -> Snapshot:
    """The predicted snapshot of a simulator run (sim.executor.RunResult)."""
    src = source or (f"simulated:{run.profile.name}" if run.profile else "reference")
    return Snapshot(run.schedule.digest(), src, {r.op_id: r.bytes() for r in run.reads},
                    {n: run.memory.digest(n) for n in run.schedule.buffers},
                    {k: [a, b] for k, (a, b) in run.timings.items()})


def first_difference(expected: Snapshot, observed: Snapshot) -> dict | None:
    """The first read (in op id order of ``expected``) whose bytes differ, and where."""
    if expected.schedule_digest != observed.schedule_digest:
        return {"what": "schedule", "expected": expected.schedule_digest, "observed": observed.schedule_digest}
    for op_id, exp in expected.reads.items():
        obs = observed.reads.get(op_id)
        if obs is None:
            return {"what": "read missing", "read": op_id}
        if obs.size != exp.size or not np.array_equal(obs, exp):
            n = min(obs.size, exp.size)
            diff = np.flatnonzero(obs[:n] != exp[:n])
            at = int(diff[0]) if diff.size else n
            return {"what": "read bytes", "read": op_id, "byte": at,
                    "bytes_differing": int(diff.size) + abs(obs.size - exp.size)}
    for name, h in expected.buffers.items():
        o = observed.buffers.get(name)
        if o is not None and _is_provenance(h) != _is_provenance(o):
            continue    # a byte digest and a provenance digest (a buffer over BYTE_DIGEST_LIMIT): not comparable
        if o != h:
            return {"what": "final buffer", "buffer": name}
    return None


def _is_provenance(d: str) -> bool:
    return d.startswith("provenance:")
