"""Scenarios: a validated, typed, nested configuration of one engine run, and its TOML presets.

A :class:`Scenario` has a ``name``, a one-line ``description`` and seven sections, each a frozen
dataclass (a :class:`~sim.engine.workload.Section`: fields typed, ranges and choices in their
metadata):

============  =======================================================================
``model``     model family and its code-path options (:data:`sim.engine.models.MODEL_OPTIONS`)
``variant``   the engine version's gate map (a shipped name or a TOML path) and the
              hypotheses applied on top (:mod:`sim.engine.hypotheses`)
``deployment``PD or colocated, GPUs, prefill and decode TP, hardware profile
``hicache``   HiCache per engine, page size, host pool ratio or size, io backend, layout,
              write policy, load fence (SGLang PR #36738), load-back threshold
``scheduler`` chunked prefill size, max running requests, device pool tokens, overlap
``workload``  :class:`~sim.engine.workload.WorkloadSpec`
``run``       simulated duration, seed, one-step forward
============  =======================================================================

Presets are TOML files in ``sim/scenarios/`` (:func:`shipped_scenarios`); a file may name a
``base`` preset whose values it overrides table by table.  :func:`load_scenario` takes a preset
name or a path and ``key=value`` overrides with dotted keys (``hicache.ratio=3``,
``workload.concurrency=1``, ``variant.hypotheses=load-unfenced,ungated-index-k``), each value
parsed by its field's type.  Every unknown key and bad value is an ``InputError`` naming the
key (``hicache.ratio``) and what was expected.  :meth:`Scenario.to_dict` / :meth:`Scenario.to_toml`
round-trip through :func:`scenario_from_dict`; :meth:`Scenario.digest` is a stable hash of the
resolved scenario (and of the trace file's bytes when it replays one).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from dataclasses import dataclass
from importlib import resources
from typing import Iterable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from sim.engine.gates import READERS, GateMap, gate_map_names, load_gate_map
from sim.engine.hypotheses import Configuration, apply_hypotheses, configuration_from_dict, hypothesis_names
from sim.engine.models import MODEL_OPTIONS, model, model_names
from sim.engine.workload import Section, Workload, WorkloadSpec, load_trace, opt
from sim.errors import InputError, check_keys, show
from sim.cache.controller import WRITE_POLICIES
from sim.pools.device import MAX_DEVICE_POOL_TOKENS
from sim.pools.host import IO_BACKENDS, resolve_layout_io_compatibility
from sim.pools.layouts import HOST_LAYOUTS, INDEX_HEAD_DIM, INDEX_SCALE_BYTES
from sim.profile import load_profile

__all__ = ["DeploymentSection", "HiCacheSection", "ModelSection", "RunSection", "SECTIONS", "Scenario",
           "SchedulerSection", "VariantSection", "apply_overrides", "load_scenario", "scenario_from_dict",
           "shipped_scenarios"]

#: page size SGLang forces per model family (DeepSeek V4: 256 raw tokens; DSA: 64)
#: the scheduler loops (``scheduler.event_loop``): SGLang's ``event_loop_normal`` / ``event_loop_overlap``
EVENT_LOOPS = ("normal", "overlap")
#: the waiting-queue orders (``scheduler.schedule_policy``): SGLang's ``fcfs`` (its default), the
#: cache-aware ``lpm`` and ``dfs-weight``, ``lof`` and ``random`` (not ``routing-key``: no routing keys)
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
FORCED_PAGE_SIZE = {"deepseek-v4-flash": 256, "dsa-v3.2": 64}
_MAX_BASE_DEPTH = 8


@dataclass(frozen=True)
class ModelSection(Section):
    SECTION: typing.ClassVar[str] = "model"

    family: str = opt("deepseek-v4-flash", "model family", choices=model_names)
    index_k_dtype: str = opt(MODEL_OPTIONS["index_k_dtype"][1], "index-K store dtype (bf16: the incident's fork)",
                             choices=MODEL_OPTIONS["index_k_dtype"][0])
    index_k_store: str = opt(MODEL_OPTIONS["index_k_store"][1], "DSA index-K store path",
                             choices=MODEL_OPTIONS["index_k_store"][0])
    indexer_path: str = opt(MODEL_OPTIONS["indexer_path"][1], "DSA indexer read path",
                            choices=MODEL_OPTIONS["indexer_path"][0])

    def options(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in MODEL_OPTIONS}


@dataclass(frozen=True)
class VariantSection(Section):
    SECTION: typing.ClassVar[str] = "variant"

    gate_map: str = opt("incident-fork", "a shipped gate map name or a gate-map TOML path")
    hypotheses: tuple[str, ...] = opt(("none",), "hypotheses applied in order", choices=hypothesis_names)

    def check(self, where: str) -> None:
        try:
            load_gate_map(self.gate_map)
        except InputError as e:
            raise InputError(f"{where}.gate_map", f"expected a shipped gate map, one of {gate_map_names()}, "
                             f"or a gate-map TOML file, got {show(self.gate_map)} ({e.message})") from None


#: the PD transfer's bounds: a fixed time of at most a second, a rate of at least 10 MB/s (slower
#: is no link between two engines' GPUs, and would stretch a run's transfers past its length)
MAX_PD_LATENCY_US = 1e6
MIN_PD_GBPS = 0.01


@dataclass(frozen=True)
class DeploymentSection(Section):
    SECTION: typing.ClassVar[str] = "deployment"

    mode: str = opt("pd", "pd: prefill and decode engines (disaggregated); colocated: one engine does both",
                    choices=("pd", "colocated"))
    gpus: int = opt(8, "GPUs in all", lo=1)
    prefill_tp: int = opt(4, "TP of a prefill engine (colocated: of the engine)", lo=1)
    decode_tp: int = opt(4, "TP of a decode engine (colocated: equal to prefill_tp)", lo=1)
    profile: str = opt("rtx-pro-6000", "hardware profile: a shipped name or a TOML path")
    simulated_ranks: int = opt(1, "ranks of the prefill TP group simulated in lockstep (1..prefill_tp; each "
                                  "its own device pool, host pool, streams and link)")
    decode_bytes: bool = opt(False, "PD: the decode engine at byte level (its pool, the KV the transfer "
                                    "lands, each step's store and reads, judged as the prefill's) without "
                                    "decode-side HiCache, as SGLang's default decode server; false: in "
                                    "simulated time only (hicache.decode = true is byte level either way)")
    pd_transfer_gbps: float = opt(0.0, "PD: the prefill -> decode KV transfer's rate in GB/s (the RDMA path "
                                       "between the two engines' GPUs); 0: the profile's h2d_gbps", lo=0)
    pd_transfer_latency_us: float = opt(-1.0, "PD: the fixed time of each KV transfer in microseconds (RDMA "
                                              "setup and completion), before its bytes; -1: the profile's "
                                              "memcpy_latency_us", lo=-1)
    pd_send: str = opt("after_forward", "PD: when the prefill's sender reads a chunk's KV. after_forward: once "
                       "the host saw the chunk's forward complete (SGLang 0.5.14; not an op); early: a non-final "
                       "chunk as soon as its forward is launched, behind a wait on an event recorded after it; "
                       "early_unfenced: the same with no wait (SGLang #33970, hypothesis pd-early-send)",
                       choices=("after_forward", "early", "early_unfenced"))

    def check(self, where: str) -> None:
        try:
            load_profile(self.profile)
        except InputError as e:
            raise InputError(f"{where}.profile", f"expected a loadable hardware profile: {e}") from None
        if self.pd_transfer_latency_us != -1 and not 0 <= self.pd_transfer_latency_us <= MAX_PD_LATENCY_US:
            raise InputError(f"{where}.pd_transfer_latency_us", "expected -1 (the profile's memcpy_latency_us) or "
                             f"a number in 0..{MAX_PD_LATENCY_US:g} (a second), got {self.pd_transfer_latency_us}")
        if self.pd_transfer_gbps != 0 and self.pd_transfer_gbps < MIN_PD_GBPS:
            raise InputError(f"{where}.pd_transfer_gbps", f"expected 0 (the profile's h2d_gbps) or at least "
                             f"{MIN_PD_GBPS:g} GB/s, got {self.pd_transfer_gbps}")
        if self.mode == "colocated" and (self.pd_transfer_gbps != 0 or self.pd_transfer_latency_us != -1):
            key = "pd_transfer_gbps" if self.pd_transfer_gbps != 0 else "pd_transfer_latency_us"
            raise InputError(f"{where}.{key}", "expected its default in colocated mode (no PD transfer: the KV "
                             "is on the engine's GPUs already)")
        if not 1 <= self.simulated_ranks <= self.prefill_tp:
            raise InputError(f"{where}.simulated_ranks", f"expected an integer in 1..{self.prefill_tp} (at most "
                             f"prefill_tp, the ranks of the prefill TP group), got {self.simulated_ranks}")
        if self.mode == "colocated":
            if self.pd_send != "after_forward":
                raise InputError(f"{where}.pd_send", "expected 'after_forward' in colocated mode (no PD transfer), "
                                 f"got {self.pd_send!r}")
            if self.decode_bytes:
                raise InputError(f"{where}.decode_bytes", "expected false in colocated mode (one engine, whose "
                                 "decode steps are byte level already), got true")
            if self.decode_tp != self.prefill_tp:
                raise InputError(f"{where}.decode_tp", f"expected prefill_tp ({self.prefill_tp}) in colocated "
                                 f"mode (one engine), got {self.decode_tp}; set {where}.decode_tp = "
                                 f"{self.prefill_tp} with {where}.prefill_tp")
            if self.gpus % self.prefill_tp:
                raise InputError(f"{where}.prefill_tp", f"expected a TP that divides gpus ({self.gpus}), "
                                 f"got {self.prefill_tp}")
        elif self.gpus % (self.prefill_tp + self.decode_tp):
            raise InputError(f"{where}.prefill_tp", f"expected prefill_tp + decode_tp to divide gpus ({self.gpus}) "
                             f"into prefill/decode pairs, got {self.prefill_tp} + {self.decode_tp}")

    def engines(self) -> str:
        if self.mode == "colocated":
            return f"{self.gpus // self.prefill_tp} x TP{self.prefill_tp} (colocated)"
        pairs = self.gpus // (self.prefill_tp + self.decode_tp)
        return f"PD prefill TP{self.prefill_tp} / decode TP{self.decode_tp}" + (f" x {pairs}" if pairs > 1 else "")


@dataclass(frozen=True)
class HiCacheSection(Section):
    SECTION: typing.ClassVar[str] = "hicache"

    prefill: bool = opt(True, "HiCache on the prefill engine (colocated: on the engine)")
    decode: bool = opt(False, "HiCache on the decode engine (colocated: equal to prefill)")
    page_size: int = opt(256, "page size in raw tokens (forced per model family by SGLang)", lo=1)
    # NOTE: SGLang sizes the host pool as device size x ratio, rounds it up by one page and asserts it
    # is larger than the device pool; ratio >= 1 is the range for which that holds for every size.
    ratio: float = opt(2.0, "host pool size / device pool size (hicache_ratio)", lo=1.0)
    size_gb: int = opt(0, "host pool size per rank in GB (hicache_size; overrides ratio when > 0)", lo=0)
    io_backend: str = opt("kernel", "hicache_io_backend", choices=IO_BACKENDS)
    layout: str = opt("page_first", "hicache_mem_layout (the layouts the host pools model)", choices=HOST_LAYOUTS)
    write_policy: str = opt("write_through", "hicache_write_policy",
                            choices=WRITE_POLICIES)
    load_fence: bool = opt(True, "the load stream waits for the forward stream (SGLang PR #36738)")
    load_back_threshold: int = opt(10, "host-hit tokens below which no load-back is made", lo=0)


@dataclass(frozen=True)
class SchedulerSection(Section):
    SECTION: typing.ClassVar[str] = "scheduler"

    chunked_prefill_size: int = opt(8192, "tokens per prefill chunk (-1: no chunking)", lo=-1)
    max_running_requests: int = opt(128, "requests in a running batch at most", lo=1)
    max_prefill_tokens: int = opt(16384, "SGLang's --max-prefill-tokens: a prefill batch's new tokens (page-rounded) "
                                  "at most, its first request excepted", lo=1)
    max_total_tokens: int = opt(1 << 20, "device KV pool size in tokens per engine", lo=1, hi=MAX_DEVICE_POOL_TOKENS)
    schedule_conservativeness: float = opt(1.0, "colocated: SGLang's --schedule-conservativeness (the new-token ratio "
                                           "admission reserves decode memory by starts at min(0.7 x this, 1))",
                                           lo=0, lo_open=True)
    schedule_policy: str = opt("fcfs", "SGLang's --schedule-policy: 'fcfs' (arrival order, its default), 'lpm' "
                               "(longest cached prefix first, device and host hits, while at most 128 wait), "
                               "'dfs-weight' (depth first over the tree, heavier subtrees first), 'lof' (longest "
                               "max_new_tokens first) or 'random'",
                               choices=SCHEDULE_POLICIES)
    overlap: bool = opt(True, "the overlap scheduler (next batch scheduled while the current one runs)")
    event_loop: str = opt("normal", "the scheduler loop: 'normal' (each batch synchronized before the next is formed) "
                          "or 'overlap' (SGLang's event_loop_overlap: batch N+1 formed and launched before batch N's "
                          "result is processed; needs overlap = true)", choices=EVENT_LOOPS)
    decode_event_loop: str = opt("normal", "PD: the decode server's loop: 'normal' (each decode step waited for "
                                 "before its finished requests are released) or 'overlap' (SGLang's "
                                 "event_loop_overlap_disagg_decode: step N+1 launched before step N's result is "
                                 "processed; needs overlap = true and a decode side at byte level)",
                                 choices=EVENT_LOOPS)


@dataclass(frozen=True)
class RunSection(Section):
    SECTION: typing.ClassVar[str] = "run"

    duration_s: float = opt(600.0, "simulated seconds", lo=0, lo_open=True)
    seed: int = opt(0, "seed of the workload, jitter and ties", lo=0)
    one_step: bool = opt(True, "advance a forward with nothing in flight in one step (same results)")
    layers: int = opt(0, "run only the model's first N layers (0: all; small runs and tests)", lo=0)


SECTIONS: Mapping[str, type[Section]] = {
    "model": ModelSection, "variant": VariantSection, "deployment": DeploymentSection,
    "hicache": HiCacheSection, "scheduler": SchedulerSection, "workload": WorkloadSpec, "run": RunSection,
}
_TOP = ("name", "description")


@dataclass(frozen=True)
class Scenario:
    """A resolved scenario (module doc).  Build it with :func:`load_scenario` or
    :func:`scenario_from_dict`; both validate."""

    name: str
    description: str
    model: ModelSection
    variant: VariantSection
    deployment: DeploymentSection
    hicache: HiCacheSection
    scheduler: SchedulerSection
    workload: WorkloadSpec
    run: RunSection

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                **{s: getattr(self, s).to_dict() for s in SECTIONS}}

    def to_toml(self) -> str:
        """TOML that :func:`scenario_from_dict` (after ``tomllib.loads``) reads back equal."""
        lines = [f"name = {_toml_value(self.name)}", f"description = {_toml_value(self.description)}"]
        for s, d in self.to_dict().items():
            if s in _TOP:
                continue
            lines += ["", f"[{s}]"] + [f"{k} = {_toml_value(v)}" for k, v in d.items()]
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        """sha256 (hex, 16 digits) of the resolved scenario's canonical JSON, plus the bytes of the
        files it names (a gate-map or profile TOML path, the trace)."""
        h = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode())
        files = [self.variant.gate_map, self.deployment.profile]
        if self.workload.kind == "trace":
            files.append(self.workload.trace)
        for path in files:
            if os.path.isfile(path):            # a named file's bytes, not just its name
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
        return h.hexdigest()[:16]

    def summary(self) -> str:
        """One line: model, GPUs and profile, engines."""
        d = self.deployment
        return f"{self.model.family}, {d.gpus} x {d.profile}, {d.engines()}"

    def gate_map(self) -> GateMap:
        return load_gate_map(self.variant.gate_map)

    def configuration(self) -> Configuration:
        """The modelled system: model, options, gate map, the fence as ``load_fence_stream``,
        then the variant's hypotheses applied in order."""
        c = configuration_from_dict({"model": self.model.family, "gate_map": self.gate_map(),
                                     "options": self.model.options(),
                                     "load_fence_stream": "forward" if self.hicache.load_fence else "schedule",
                                     "pd_send": self.deployment.pd_send},
                                    "scenario")
        return apply_hypotheses(c, self.variant.hypotheses)

    def make_workload(self) -> Workload:
        return Workload(self.workload, seed=self.run.seed)

    def check(self) -> None:
        """Relations between sections: page size, index-K dtype, gate map coverage, TP geometry,
        colocated HiCache, pool sizes, trace file."""
        fam = model(self.model.family)
        forced = FORCED_PAGE_SIZE.get(fam.name)
        if forced is not None and self.hicache.page_size != forced:
            raise InputError("hicache.page_size", f"expected {forced} for model {fam.name} (SGLang forces it), "
                             f"got {self.hicache.page_size}")
        if self.model.index_k_dtype == "bf16" and fam.bf16_index_k is None:
            raise InputError("model.index_k_dtype", f"expected 'fp8': model {fam.name} has no bf16 index-K variant")
        gm, opts = self.gate_map(), self.model.options()
        for kind in dict.fromkeys(fam.layer_kinds):
            for mode in ("extend", "decode"):
                for step in fam.steps[kind]:
                    if not step.applies(mode, opts):
                        continue
                    missing = [a for a in READERS.get(step.reader, ()) if a not in gm.gated]
                    if missing:
                        raise InputError("variant.gate_map", f"gate map {gm.name!r} does not list accessor "
                                         f"{missing[0]!r}, which {fam.name} calls in {step.reader}; expected a "
                                         f"map of that engine version (shipped: {gate_map_names()})")
        heads = fam.dims.heads
        for key in ("prefill_tp", "decode_tp"):
            tp = getattr(self.deployment, key)
            if heads % tp:
                raise InputError(f"deployment.{key}", f"expected a TP that divides {fam.name}'s {heads} attention "
                                 f"heads, got {tp}")
        if self.deployment.mode == "colocated" and self.hicache.decode != self.hicache.prefill:
            raise InputError("hicache.decode", f"expected hicache.prefill ({str(self.hicache.prefill).lower()}) in "
                             "colocated mode (one engine)")
        check_decode_hicache(self)
        if self.hicache.size_gb and fam.name == "deepseek-v4-flash":
            # NOTE: the session refused it naming its internal key (config.hicache_size), which no
            # scenario key sets (found by benchmarks/fuzz_engine.py)
            raise InputError("hicache.size_gb", f"expected 0 for model {fam.name} (SGLang's DeepSeek V4 HiCache "
                             f"does not support --hicache-size; use hicache.ratio), got {self.hicache.size_gb}")
        ps = self.hicache.page_size
        if self.scheduler.max_total_tokens % ps or self.scheduler.max_total_tokens < 2 * ps:
            raise InputError("scheduler.max_total_tokens", f"expected a multiple of page_size ({ps}) of at least "
                             f"2 pages, got {self.scheduler.max_total_tokens}")
        cps = self.scheduler.chunked_prefill_size
        if cps != -1 and cps < ps:
            raise InputError("scheduler.chunked_prefill_size", f"expected -1 (off) or at least page_size ({ps}), "
                             f"got {cps}")
        if self.scheduler.event_loop == "overlap" and not self.scheduler.overlap:
            raise InputError("scheduler.event_loop", "expected 'normal' with scheduler.overlap = false (SGLang runs "
                             "event_loop_overlap only in overlap mode), got 'overlap'")
        if self.scheduler.decode_event_loop == "overlap":
            if self.deployment.mode != "pd":
                raise InputError("scheduler.decode_event_loop", "expected 'normal' in colocated mode (its decode steps "
                                 "run in the one engine's loop: set scheduler.event_loop), got 'overlap'")
            if not self.scheduler.overlap:
                raise InputError("scheduler.decode_event_loop", "expected 'normal' with scheduler.overlap = false "
                                 "(SGLang runs event_loop_overlap_disagg_decode only in overlap mode), got 'overlap'")
            if not (self.deployment.decode_bytes or self.hicache.decode):
                raise InputError("scheduler.decode_event_loop", "expected 'normal' while the decode side runs in "
                                 "simulated time only (the overlap loop changes only what happens to bytes): set "
                                 "deployment.decode_bytes = true (or hicache.decode = true) to run it at byte level, "
                                 "got 'overlap'")
        if self.workload.kind == "trace":
            load_trace(self.workload.trace, self.workload.system_prompt_tokens)
        cfg = self.configuration()
        self._check_index_k_stride(cfg)

    def _check_index_k_stride(self, cfg: Configuration) -> None:
        """A host index-K stride other than the device's (``index-k-stride-mismatch``) with the
        ``direct`` io backend (asked for, or resolved from ``page_first_direct``): refused,
        naming ``hicache.io_backend``, as ``CacheSession`` refuses it (direct copies whole
        tensor rows, which fails when host and device rows differ).

        NOTE: without this check the session's own error named its internal key
        (``config.index_k_host_bytes_per_entry``), which no scenario key sets (found by
        ``benchmarks/fuzz_engine.py``)."""
        host_entry = cfg.index_k_host_bytes_per_entry
        if not host_entry:
            return
        layout, io = resolve_layout_io_compatibility(self.hicache.layout, self.hicache.io_backend)
        device_entry = INDEX_HEAD_DIM + INDEX_SCALE_BYTES if self.model.index_k_dtype == "fp8" else 2 * INDEX_HEAD_DIM
        if io == "direct" and host_entry != device_entry:
            hyps = [h for h in self.variant.hypotheses if h != "none"]
            raise InputError("hicache.io_backend", f"expected 'kernel' and a layout other than 'page_first_direct' "
                             f"with a host index-K entry of {host_entry} bytes against the device's {device_entry} "
                             f"(variant.hypotheses {hyps}): the direct backend copies whole tensor rows, which "
                             f"fails when host and device rows differ; got io_backend {self.hicache.io_backend!r}, "
                             f"layout {self.hicache.layout!r} (resolved: {io}, {layout})")


def check_decode_hicache(sc: "Scenario") -> None:
    """PD with ``hicache.decode = true``: the decode engine runs at byte level with its own
    HiCache (``sim.engine.decode_hicache``), which SGLang 0.5.14 offers only for models that
    are not hybrid SWA: refused (an ``InputError`` naming ``hicache.decode``) for DeepSeek V4.

    NOTE: SGLang's ``kv_cache_builder`` raises ``ValueError`` for
    ``--disaggregation-decode-enable-radix-cache`` on a hybrid SWA model, and
    ``DeepseekV4ForCausalLM`` is one (``is_hybrid_swa_model``): the decode side of the
    incident's deployment cannot have HiCache (docs/engine.md)."""
    if sc.deployment.mode == "pd" and sc.hicache.decode and model(sc.model.family).name != "dsa-v3.2":
        raise InputError("hicache.decode", f"expected false for model {sc.model.family} in PD mode: SGLang 0.5.14 "
                         "refuses the decode-side radix cache (and so decode-side HiCache) for hybrid SWA models "
                         "such as DeepSeek V4; decode-side HiCache is modelled for dsa-v3.2, got true")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        # NOTE: a JSON string is a TOML basic string, with two exceptions handled here.
        # ASCII JSON writes a character beyond the BMP as a surrogate pair (\uD83D\uDE00),
        # which TOML refuses: so non-ASCII characters stay literal (UTF-8).  JSON leaves DEL
        # bare, which TOML refuses: so it is escaped by hand.
        if any("\ud800" <= c <= "\udfff" for c in v):
            raise InputError("scenario", f"cannot write {show(v)} as TOML: it holds a lone surrogate")
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise InputError("scenario", f"cannot write {show(v)} as TOML")


# ---------------------------------------------------------------- building and loading

def scenario_from_dict(d: Mapping, where: str = "scenario") -> Scenario:
    """A validated scenario from a plain dict (a TOML document without ``base``)."""
    if not isinstance(d, Mapping):
        raise InputError(where, f"expected a table, got {show(d)}")
    check_keys(d, (*_TOP, *SECTIONS), where)
    for k in _TOP:
        if not isinstance(d.get(k, ""), str):
            raise InputError(k, f"expected a string, got {show(d.get(k))}")
    sections = {name: cls.from_dict(d.get(name), name) for name, cls in SECTIONS.items()}
    sc = Scenario(d.get("name", "") or "scenario", d.get("description", ""), **sections)
    sc.check()
    return sc


def shipped_scenarios() -> list[str]:
    files = resources.files("sim") / "scenarios"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".toml"))


def _read_doc(name_or_path: str, depth: int = 0) -> dict:
    """The TOML document of a preset or a file, its ``base`` chain merged in (table by table)."""
    if depth > _MAX_BASE_DEPTH:
        raise InputError("base", f"more than {_MAX_BASE_DEPTH} levels of base presets (a cycle?)")
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InputError("scenario", f"expected a preset name or a scenario TOML path, got {show(name_or_path)}")
    if os.path.isfile(name_or_path):
        try:
            with open(name_or_path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise InputError("scenario", f"cannot read {name_or_path!r}: {e.strerror}") from None
        where, stem = name_or_path, os.path.splitext(os.path.basename(name_or_path))[0]
        here = os.path.dirname(os.path.abspath(name_or_path))
    else:
        res = resources.files("sim") / "scenarios" / f"{name_or_path}.toml"
        if not res.is_file():
            raise InputError("scenario", f"no scenario file {name_or_path!r} and no preset of that name; "
                             f"expected a path or one of {shipped_scenarios()}")
        text, where, stem, here = res.read_bytes(), f"scenario {name_or_path}", name_or_path, None
    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(where, f"expected a valid TOML scenario, got a TOML error: {e}") from None
    trace = doc.get("workload", {}).get("trace") if isinstance(doc.get("workload"), dict) else None
    if here and isinstance(trace, str) and trace and not os.path.isabs(trace):
        doc["workload"]["trace"] = os.path.join(here, trace)     # relative to the scenario file
    doc.setdefault("name", stem)
    base = doc.pop("base", None)
    if base is None:
        return doc
    if not isinstance(base, str) or base not in shipped_scenarios() or base == stem:
        raise InputError("base", f"expected another preset, one of {shipped_scenarios()}, got {show(base)}")
    merged = _read_doc(base, depth + 1)
    for k, v in doc.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **v}
        else:
            merged[k] = v
    return merged


def apply_overrides(doc: dict, overrides: Iterable[str]) -> dict:
    """``doc`` with each ``section.key=value`` set, the value parsed by that field's type."""
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise InputError("--set", f"expected key=value (e.g. hicache.ratio=3), got {show(item)}")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise InputError("--set", f"expected key=value with a key (e.g. hicache.ratio=3), got {show(item)}")
        if key in _TOP:
            doc[key] = text
            continue
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise InputError(key, f"expected a key section.name with section one of {list(SECTIONS)} "
                             f"(or one of {list(_TOP)}), got unknown section {show(section)}")
        cls = SECTIONS[section]
        check_keys({name: None}, [f.name for f in dataclasses.fields(cls)], section)
        sec = doc.get(section)
        doc[section] = {**(sec if isinstance(sec, dict) else {}), name: cls.parse_text(name, text, section)}
    return doc


def load_scenario(name_or_path: str, overrides: Iterable[str] = ()) -> Scenario:
    """A preset (by name) or a scenario TOML file, with ``key=value`` overrides applied."""
    return scenario_from_dict(apply_overrides(_read_doc(name_or_path), overrides))
