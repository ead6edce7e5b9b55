"""The engine model's data and per-batch building blocks.

* :mod:`sim.engine.models`: model families as data (layers, layer kinds, pools, the ordered
  accessor calls of each layer);
* :mod:`sim.engine.gates`: gate maps (which accessors wait on the layer-load event) per
  engine version, loadable from a dict or TOML;
* :mod:`sim.engine.cost`: the roofline cost model of compute ops (profile ``[compute]`` terms);
* :mod:`sim.engine.forward`: one batch's forward pass issued as stream ops through a
  :class:`sim.executor.Host`, per layer or in one step, and the indexer's top-k verdict;
* :mod:`sim.engine.hypotheses`: the configuration and the registry of named switches;
* :mod:`sim.engine.engine`: the prefill engine (first slice: one rank, HiCache on, byte-level verdicts).

See ``docs/engine.md``.
"""
from __future__ import annotations

from sim.engine.cost import CostModel, CostParams, OpCost, step_cost
from sim.engine.forward import (BatchRequest, ForwardBatch, ForwardIssue, ReadInfo, TopkVerdict,
                                can_advance_in_one_step, copies_in_flight, entry_bytes, indexer_topk, issue_forward, topk_verdict)
from sim.engine.gates import GATE_MAPS, GateMap, gate_map, gate_map_from_dict, load_gate_map
from sim.engine.hypotheses import (Configuration, Hypothesis, apply_hypotheses, configuration,
                                   configuration_from_dict, hypothesis, hypothesis_names, register)
from sim.engine.models import MODELS, ModelFamily, model
from sim.engine.engine import EngineError, EngineResult, OwnershipError, PrefillEngine, reduced_model, run_prefill_engine

__all__ = ["BatchRequest", "Configuration", "CostModel", "EngineError", "EngineResult", "OwnershipError", "PrefillEngine", "CostParams", "ForwardBatch", "ForwardIssue",
           "GATE_MAPS", "GateMap", "Hypothesis", "MODELS", "ModelFamily", "OpCost", "ReadInfo", "TopkVerdict",
           "apply_hypotheses", "can_advance_in_one_step", "configuration", "configuration_from_dict", "copies_in_flight", "entry_bytes",
           "gate_map", "gate_map_from_dict", "hypothesis", "hypothesis_names", "indexer_topk", "issue_forward",
           "load_gate_map", "model", "reduced_model", "register", "run_prefill_engine", "step_cost", "topk_verdict"]
