"""Hypotheses: named switches that change the model, never the measurement.

A :class:`Configuration` is everything about the modelled system a bug
explanation may change: the model family and its code-path options, the gate
map, and the cache/controller keys below.  It holds nothing about what is
measured (workload, seeds, metrics), so a :class:`Hypothesis` (a pure
``Configuration -> Configuration`` transform) cannot touch the measurement.

Shipped switches (:func:`hypothesis_names`):

==========================  ==========================================================
``none``                    nothing changes (the baseline)
``ungated-index-k``         every index-K accessor in the gate map skips the gate
``ungated-index-k-bf16``    only the fork's bf16 index-K accessor skips it
``index-k-c4-token-copy``   index-K partial-page transfers use the C4 token routine
``index-k-stride-mismatch`` the host index-K pool keeps the fp8 page stride (132 B an
                            entry) while the device stores bf16 (256 B)
``load-unfenced``           the load stream is not fenced behind the forward stream
                            (SGLang before PR #36738)
``host-freed-during-load``  host slots of an in-flight load may be freed (PR #26728's
                            missing host lock)
``index-k-not-backed-up``   index-K never reaches the host pool (SGLang #17085)
``index-k-not-transferred`` the PD transfer never sends index-K to the decode engine
                            (SGLang #24878's class)
``graph-replay-no-waits``   a prefill batch that loads and fits the captured prefill CUDA
                            graph (8,192 tokens) replays it, and a graph captured with no
                            load in flight holds no waits
``pd-early-send``           PD: a non-final chunk's KV is sent (read over RDMA) as soon as
                            its forward is launched, with no wait on it (SGLang #33970)
==========================  ==========================================================

The first two act on the gate map (data of :mod:`sim.engine.gates`), which the
forward model honours.  The others set **controller keys** that the engine must
honour (:data:`CONTROLLER_KEYS`):

* ``index_k_partial_pages``: ``"page_aligned"`` (default: an index-K transfer
  whose token range does not fill whole pages is widened to whole pages and
  copied by the page routine) or ``"dsv4_token"`` (the tokens of a partial page
  are copied by ``transfer_cache_dsv4_mla``, whose C4 constants are fixed).  The
  engine counts the branch taken either way.
* ``index_k_host_bytes_per_entry``: ``0`` (default: the host index-K pool has
  the device's geometry) or the bytes per entry the host pool is built with
  (the hypothesis sets 132, fp8 key + scale, the stride before the dtype change).
* ``load_fence_stream``: ``"forward"`` (default: ``start_loading`` records its
  start event after the forward stream's work, PR #36738) or ``"schedule"``
  (only after the scheduler stream, so a load can land in pages the previous
  round's forward still writes).
* ``host_lock_during_load``: ``True`` (default) or ``False`` (host eviction may
  free, and reuse, the host slots a running load reads).
* ``backup_pools``: the pool roles that backups write to the host pool and
  load-backs restore (default: every pool of the model).
* ``transfer_pools``: the pool roles whose KV the PD transfer moves from the
  prefill engine into the decode engine's slots (default: every pool of the
  model).  A configuration that leaves a pool out runs a PD decode engine at
  byte level (``deployment.decode_bytes``), since only its reads can see what
  was not sent; colocated, there is no transfer and the key changes nothing.
* ``graph_replay_max_tokens``: ``0`` (default: a batch that loads runs its
  accessors eagerly, each gated one waiting as the gate map says) or the token
  bound of the captured prefill CUDA graph: a batch that loads (consumer index
  ``>= 0``) with at most this many new tokens replays the graph, in which no
  accessor waits.  NOTE: ``wait_until`` is a host-issued ``wait_event`` on the
  current stream; a graph is captured with consumer index ``-1`` (no load), so
  none was recorded into it (reference/sglang_hicache.md section 7.3: SGLang
  0.5.14's scheduler notes that graph execution should be turned off when a
  HiCache load is triggered, and does not do it; TokenSpeed PR #370 hit the
  same with a decode graph).  0.5.14 turns the prefill graph off under HiCache
  or PD only when its backend was not set explicitly
  (``_apply_cuda_graph_compatibility``).  Whether a prefill graph captures an
  accessor depends on where it is split (attention runs between the pieces):
  this switch states the worst case, every accessor inside.
* ``pd_send``: ``"after_forward"`` (default: SGLang 0.5.14's prefill sends a
  chunk's KV only after the host has seen the chunk's forward complete: the
  normal loop in the next iteration's ``process_prefill_chunk``, after the
  result was synchronised; the overlap loop in ``process_batch_result`` after
  ``copy_done.synchronize()``; so the sender's RDMA read cannot race the forward
  and is not modelled as an op), ``"early"`` (a non-final chunk's KV is read by
  the sender as soon as the chunk's forward is launched, on a stream of its own,
  behind a wait on an event recorded after the forward: the transfer backend that
  uses the early-send wait event) or ``"early_unfenced"`` (the same read without
  the wait: SGLang #33970, the backend that does not use it).  The early read
  covers the pools the sender moves with every chunk
  (:attr:`~sim.engine.models.ModelFamily.chunk_sent_roles`); it is judged as a
  read made for its request.  PD only; colocated, there is no transfer.

Users add switches without editing the engine: call :func:`register` with a
:class:`Hypothesis`, or publish one under the entry point group
``kvrace.hypotheses`` (the entry point loads to a Hypothesis, an iterable of
them, or a zero-argument callable returning either); entry points are loaded
the first time a name is looked up or listed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from sim.engine.gates import ACCESSORS, GateMap, gate_map
from sim.engine.models import MODELS, model, resolve_options
from sim.errors import InputError, check_keys, require, show

__all__ = ["CONTROLLER_KEYS", "Configuration", "ENTRY_POINT_GROUP", "Hypothesis", "apply_hypotheses",
           "configuration", "configuration_from_dict", "hypothesis", "hypothesis_names", "register"]

ENTRY_POINT_GROUP = "kvrace.hypotheses"

#: controller key -> (allowed values or a type, default); the pool sets' default is the model's pools
CONTROLLER_KEYS: Mapping[str, tuple] = MappingProxyType({
    "index_k_partial_pages": (("page_aligned", "dsv4_token"), "page_aligned"),
    "index_k_host_bytes_per_entry": (int, 0),
    "load_fence_stream": (("forward", "schedule"), "forward"),
    "host_lock_during_load": (bool, True),
    "backup_pools": (frozenset, None),
    "graph_replay_max_tokens": (int, 0),
    "transfer_pools": (frozenset, None),
    "pd_send": (("after_forward", "early", "early_unfenced"), "after_forward"),
})


@dataclass(frozen=True)
class Configuration:
    """The modelled system's configuration (see the module doc).  Build it with
    :func:`configuration`; change it with :meth:`replace` (validated)."""

    model: str
    gate_map: GateMap
    options: Mapping[str, str]
    index_k_partial_pages: str = "page_aligned"
    index_k_host_bytes_per_entry: int = 0
    load_fence_stream: str = "forward"
    host_lock_during_load: bool = True
    backup_pools: frozenset = frozenset()
    graph_replay_max_tokens: int = 0
    transfer_pools: frozenset = frozenset()
    pd_send: str = "after_forward"
    hypotheses: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __hash__(self):
        return hash((self.model, self.gate_map, tuple(sorted(self.options.items())), self.index_k_partial_pages,
                     self.index_k_host_bytes_per_entry, self.load_fence_stream, self.host_lock_during_load,
                     self.backup_pools, self.graph_replay_max_tokens, self.transfer_pools, self.pd_send,
                     self.hypotheses))

    def __eq__(self, other):
        return isinstance(other, Configuration) and self.to_dict() == other.to_dict()

    @property
    def family(self):
        return MODELS[self.model]

    def replace(self, **changes) -> "Configuration":
        d = self.to_dict()
        for k, v in changes.items():
            require(k in d, f"configuration.{k}", f"expected one of {sorted(d)}")
        gm = changes.pop("gate_map", self.gate_map)
        d.update(changes)
        d["gate_map"] = gm
        return configuration_from_dict(d)

    def to_dict(self) -> dict:
        return {"model": self.model, "gate_map": self.gate_map, "options": dict(self.options),
                "index_k_partial_pages": self.index_k_partial_pages,
                "index_k_host_bytes_per_entry": self.index_k_host_bytes_per_entry,
                "load_fence_stream": self.load_fence_stream, "host_lock_during_load": self.host_lock_during_load,
                "backup_pools": sorted(self.backup_pools), "graph_replay_max_tokens": self.graph_replay_max_tokens,
                "transfer_pools": sorted(self.transfer_pools), "pd_send": self.pd_send,
                "hypotheses": list(self.hypotheses)}


def configuration(model_name: str = "deepseek-v4-flash", gate_map_name: str | GateMap = "incident-fork",
                  options: Mapping[str, str] | None = None, **controller) -> Configuration:
    """A validated configuration: model family, gate map (name or :class:`GateMap`), model
    options (:data:`sim.engine.models.MODEL_OPTIONS`) and controller keys."""
    return configuration_from_dict({"model": model_name, "gate_map": gate_map_name, "options": options or {},
                                    **controller})


def configuration_from_dict(d: Mapping, where: str = "configuration") -> Configuration:
    check_keys(d, ("model", "gate_map", "options", "hypotheses", *CONTROLLER_KEYS), where, required=("model",))
    fam = model(d["model"]) if isinstance(d["model"], str) else None
    require(fam is not None, f"{where}.model", f"expected a model name, got {show(d['model'])}")
    gm = d.get("gate_map", "incident-fork")
    if isinstance(gm, str):
        gm = gate_map(gm)
    require(isinstance(gm, GateMap), f"{where}.gate_map", f"expected a gate map name or GateMap, got {show(gm)}")
    options = resolve_options(d.get("options"), f"{where}.options")
    pools = frozenset(fam.pools)
    values = {}
    for k, (allowed, default) in CONTROLLER_KEYS.items():
        v = d.get(k, default)
        if allowed is frozenset:
            v = pools if v is None else v
            require(isinstance(v, (list, tuple, set, frozenset)) and all(isinstance(x, str) for x in v),
                    f"{where}.{k}", f"expected a list of pool roles, got {show(v)}")
            bad = sorted(set(v) - pools)
            require(not bad, f"{where}.{k}", f"expected pool roles of {fam.name} {sorted(pools)}, got {bad}")
            v = frozenset(v)
        elif isinstance(allowed, tuple):
            require(v in allowed, f"{where}.{k}", f"expected one of {list(allowed)}, got {show(v)}")
        elif allowed is bool:
            require(isinstance(v, bool), f"{where}.{k}", f"expected true or false, got {show(v)}")
        else:
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{where}.{k}",
                    f"expected an integer >= 0, got {show(v)}")
        values[k] = v
    hyps = d.get("hypotheses", ())
    require(isinstance(hyps, (list, tuple)) and all(isinstance(h, str) for h in hyps), f"{where}.hypotheses",
            f"expected a list of names, got {show(hyps)}")
    return Configuration(fam.name, gm, options, hypotheses=tuple(hyps), **values)


@dataclass(frozen=True)
class Hypothesis:
    """A named switch: ``transform`` maps a configuration to the one the explanation
    claims; ``keys`` names the configuration fields it may change (checked on apply)."""

    name: str
    summary: str
    transform: Callable[[Configuration], Configuration]
    keys: tuple[str, ...] = ()
    source: str = ""

    def apply(self, config: Configuration) -> Configuration:
        out = self.transform(config)
        if not isinstance(out, Configuration):
            raise InputError(f"hypothesis {self.name}", f"its transform returned {type(out).__name__}, "
                             "expected a Configuration")
        before, after = config.to_dict(), out.to_dict()
        changed = sorted(k for k in before if k != "hypotheses" and before[k] != after[k])
        bad = [k for k in changed if k not in self.keys]
        require(not bad, f"hypothesis {self.name}", f"changed {bad}, outside its declared keys {list(self.keys)}")
        return dataclasses.replace(out, hypotheses=config.hypotheses + (self.name,))


# ---------------------------------------------------------------- shipped switches

def _ungate(config: Configuration, accessors, suffix: str) -> Configuration:
    gm = config.gate_map
    changes = {a: False for a in accessors if a in gm.gated}
    return config.replace(gate_map=gm.override(changes, name=f"{gm.name}+{suffix}"))


def _without_index_k(c: Configuration, pools) -> list[str]:
    return sorted(r for r in pools if not c.family.pools_for(c.options)[r].index_k)


def _ungated_index_k(c: Configuration) -> Configuration:
    return _ungate(c, [a for a, role in ACCESSORS.items() if role == "index_k"], "ungated-index-k")


def _ungated_index_k_bf16(c: Configuration) -> Configuration:
    return _ungate(c, ["get_index_k_bf16_buffer"], "ungated-index-k-bf16")


_SHIPPED = (
    Hypothesis("none", "nothing changes: the configuration as given", lambda c: c),
    Hypothesis("ungated-index-k", "every index-K accessor skips the layer-load gate", _ungated_index_k,
               ("gate_map",), "sglang PR #22811 (the 0.5.10 class, generalised)"),
    Hypothesis("ungated-index-k-bf16", "only the bf16 index-K read path skips the gate", _ungated_index_k_bf16,
               ("gate_map",), "reference/incident.md explanation 1"),
    Hypothesis("index-k-c4-token-copy", "index-K partial-page transfers go through the C4 token routine",
               lambda c: c.replace(index_k_partial_pages="dsv4_token"), ("index_k_partial_pages",),
               "reference/incident.md explanation 2 (transfer_cache_dsv4_mla)"),
    Hypothesis("index-k-stride-mismatch",
               "the host index-K pool keeps the fp8 stride (132 B an entry) after the bf16 change",
               lambda c: c.replace(index_k_host_bytes_per_entry=132), ("index_k_host_bytes_per_entry",),
               "reference/incident.md (the dtype patch)"),
    Hypothesis("load-unfenced", "the load stream is not fenced behind the forward stream",
               lambda c: c.replace(load_fence_stream="schedule"), ("load_fence_stream",), "sglang PR #36738"),
    Hypothesis("host-freed-during-load", "host slots of an in-flight load may be freed and reused",
               lambda c: c.replace(host_lock_during_load=False), ("host_lock_during_load",),
               "sglang PRs #26728, #34519, #36317"),
    Hypothesis("index-k-not-backed-up", "the indexer buffers never reach the host pool",
               lambda c: c.replace(backup_pools=_without_index_k(c, c.backup_pools)), ("backup_pools",),
               "sglang #17085"),
    Hypothesis("index-k-not-transferred", "the PD transfer never sends the indexer buffers to the decode engine",
               lambda c: c.replace(transfer_pools=_without_index_k(c, c.transfer_pools)), ("transfer_pools",),
               "sglang #24878 (DeepSeek V4's indexer state never sent over Mooncake)"),
    # NOTE: 8192 is the token bound SGLang 0.5.14's PrefillCudaGraphRunner falls back to when no
    # capture sizes are given; register a variant for another bound
    Hypothesis("graph-replay-no-waits",
               "a batch that loads and fits the captured prefill graph (8,192 tokens) replays it: no accessor waits",
               lambda c: c.replace(graph_replay_max_tokens=8192), ("graph_replay_max_tokens",),
               "reference/sglang_hicache.md 7.3 (SGLang scheduler note; TokenSpeed PR #370)"),
    Hypothesis("pd-early-send",
               "PD: a non-final chunk's KV is read by the sender as soon as its forward is launched, unfenced",
               lambda c: c.replace(pd_send="early_unfenced"), ("pd_send",),
               "sglang #33970 (corruption on prefill chunk boundaries with Mooncake)"),
)

_REGISTRY: dict[str, Hypothesis] = {h.name: h for h in _SHIPPED}
_entry_points_loaded = False


def register(h: Hypothesis, *, replace: bool = False) -> Hypothesis:
    """Add a switch to the registry (``replace=True`` to redefine a name)."""
    require(isinstance(h, Hypothesis), "hypothesis", f"expected a Hypothesis, got {type(h).__name__}")
    require(isinstance(h.name, str) and 0 < len(h.name) <= 64, "hypothesis.name",
            f"expected a name of 1..64 characters, got {show(h.name)}")
    require(replace or h.name not in _REGISTRY, f"hypothesis {h.name}",
            "already registered; pass replace=True to redefine it")
    bad = [k for k in h.keys if k not in Configuration.__dataclass_fields__ or k == "hypotheses"]
    require(not bad, f"hypothesis {h.name}.keys", f"unknown configuration keys {bad}")
    _REGISTRY[h.name] = h
    return h


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if callable(obj) and not isinstance(obj, Hypothesis):
            obj = obj()
        for h in ([obj] if isinstance(obj, Hypothesis) else list(obj)):
            register(h, replace=True)


def hypothesis_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def hypothesis(name: str) -> Hypothesis:
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise InputError("hypothesis", f"expected one of {sorted(_REGISTRY)}, got {show(name)}")
    return _REGISTRY[name]


def apply_hypotheses(config: Configuration, names: Iterable[str]) -> Configuration:
    """``config`` with each named switch applied in turn."""
    for n in names:
        config = hypothesis(n).apply(config)
    return config
