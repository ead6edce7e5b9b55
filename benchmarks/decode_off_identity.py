"""Check that ``hicache.decode = false`` runs are bit-identical across two source trees.

    git archive <before> | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python benchmarks/decode_off_identity.py > /tmp/before.json
    PYTHONPATH=.           python benchmarks/decode_off_identity.py > /tmp/after.json
    cmp /tmp/before.json /tmp/after.json

Prints, as one JSON list, the ``EngineResult.signature()`` of three short runs with the decode
side in simulated time: ``glm5-22811-small`` colocated, the same in PD with
``hicache.decode = false``, and ``incident-repro`` (DeepSeek V4, PD) cut to 4 layers and 0.5 s.
The tree imported is the first ``sim`` on ``sys.path`` (set ``PYTHONPATH``).
"""
from __future__ import annotations

import json

from sim.engine.engine import run_prefill_engine

CASES = [
    ("glm5-22811-small", ["run.layers=2"]),
    ("glm5-22811-small", ["run.layers=2", "deployment.mode=pd", "deployment.prefill_tp=4", "deployment.decode_tp=4",
                          "hicache.decode=false"]),
    ("incident-repro", ["run.layers=4", "run.duration_s=0.5"]),
]


def main() -> None:
    out = [run_prefill_engine(name, overrides=sets).signature() for name, sets in CASES]
    print(json.dumps(out, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
