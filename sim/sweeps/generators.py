"""Parametrised schedule generators: the families a sweep walks over.

A **generator** turns a point (a dict of parameter values) into a kvrace
schedule document.  Each parameter is declared with its type, default and
bounds, so ``--grid key=v1,v2`` can be checked against it, and a point's
key is the canonical form of *all* its values (defaults included): the same
point has the same key in any grid, which is what makes sweeps resumable.

Adding a generator (see ``docs/sweeps.md``)::

    from sim.sweeps.generators import Generator, Param, register

    def build(p):                       # p: every parameter, checked
        return {"kvrace_schedule": 2, "name": ..., "buffers": [...], ...}

    register(Generator("my_race", "what it models", (Param("compute_us", float, 3.0, "..."),), build,
                       x="compute_us"))

Put it in a module and pass ``--import MODULE`` to ``kvrace sweep`` (the
workers import it too), or add it to this file.

Parameters named in ``PROFILE_OVERRIDES`` are not schedule keys: they replace
the hardware profile's field of that name for the point (``None``, spelt
``profile`` on the command line, keeps the profile's value).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from sim.errors import InputError, check_keys, show

__all__ = ["GENERATORS", "PROFILE_OVERRIDES", "Generator", "Param", "get_generator", "minimal_race",
           "register"]

#: parameter name -> the ``sim.profile.Profile`` field it replaces
PROFILE_OVERRIDES = {"launch_jitter_us": "launch_jitter_us", "link_sharing": "link_sharing",
                     "compute_jitter_frac": "jitter_frac"}

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Param:
    """One parameter of a generator.

    ``kind`` is ``int``, ``float``, ``bool`` or ``str``; ``minimum`` bounds
    numbers (inclusive), ``choices`` restricts values.  ``default`` may be
    ``None`` only for a profile override (``None``: keep the profile's value)."""

    name: str
    kind: type
    default: Any
    help: str
    minimum: float | None = None
    choices: tuple | None = None

    def expected(self) -> str:
        """What a value must be, in words (used in every error message)."""
        if self.choices is not None:
            text = f"one of {', '.join(map(str, self.choices))}"
        elif self.kind is bool:
            text = "true or false"
        else:
            text = {int: "a whole number", float: "a finite number", str: "a text"}[self.kind]
            if self.minimum is not None:
                text += f" >= {self.minimum:g}"
        return text + (" or 'profile' (keep the profile's value)" if self.name in PROFILE_OVERRIDES else "")

    def parse(self, text: str, where: str):
        """A command-line value (``--grid key=TEXT``), checked."""
        t = text.strip()
        if self.name in PROFILE_OVERRIDES and t == "profile":
            return None
        try:
            if self.kind is bool:
                if t.lower() not in _TRUE + _FALSE:
                    raise ValueError
                value = t.lower() in _TRUE
            elif self.kind is int:
                value = int(t)
            elif self.kind is float:
                value = float(t)
            else:
                value = t
        except ValueError:
            raise InputError(where, f"expected {self.expected()}, got {show(text)}") from None
        return self.check(value, where)

    def check(self, value, where: str):
        """A value given in Python or JSON, checked and normalised to ``kind``."""
        if value is None and self.name in PROFILE_OVERRIDES:
            return None
        ok = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if ok and self.kind is float:
            ok = math.isfinite(value)
        if ok and self.minimum is not None:
            ok = value >= self.minimum
        if ok and self.choices is not None:
            ok = value in self.choices
        if not ok:
            raise InputError(where, f"expected {self.expected()}, got {show(value)}")
        return value


@dataclass(frozen=True)
class Generator:
    """A family of schedules: ``build(point) -> schedule document``.

    ``derived(point) -> dict`` adds columns computed from a point (bytes
    loaded, say) that plots can use as an axis; ``reads`` names the read ops
    whose outcome a trial counts (empty: every read of the schedule).  ``x``
    and ``lines`` are the default axes of ``kvrace plot sweep``."""

    name: str
    description: str
    params: tuple[Param, ...]
    build: Callable[[dict], dict]
    derived: Callable[[dict], dict] | None = None
    reads: tuple[str, ...] = ()
    x: str | None = None
    lines: str | None = None
    by_name: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "by_name", {p.name: p for p in self.params})

    def point(self, values: Mapping | None = None, where: str = "point") -> dict:
        """Every parameter's value: ``values`` over the defaults, checked, in
        declaration order."""
        values = dict(values or {})
        check_keys(values, list(self.by_name), where, context=f" (parameters of generator {self.name})")
        return {p.name: p.check(values.get(p.name, p.default), f"{where}.{p.name}") for p in self.params}

    def columns(self, point: Mapping) -> dict:
        """The derived columns of a point (empty without ``derived``)."""
        return dict(self.derived(point)) if self.derived else {}


#: generator name -> Generator (``register`` adds to it)
GENERATORS: dict[str, Generator] = {}


def register(gen: Generator, *, replace: bool = False) -> Generator:
    """Add ``gen`` to the registry; a second generator of one name is refused
    unless ``replace``."""
    if gen.name in GENERATORS and not replace and GENERATORS[gen.name] is not gen:
        raise InputError("generator", f"a generator named {gen.name!r} is already registered")
    GENERATORS[gen.name] = gen
    return gen


def get_generator(name: str) -> Generator:
    if name not in GENERATORS:
        raise InputError("generator", f"expected one of {', '.join(sorted(GENERATORS))}, got {show(name)}")
    return GENERATORS[name]


# ---------------------------------------------------------------- the minimal race

def _minimal_race_doc(p: dict) -> dict:
    """``examples/index_k_ungated_race.json`` with its sizes as parameters.

    HiCache loads layer 0 of a ``pages``-page index-K prefix (request 12)
    from the pinned host pool (``layer_first``, ``2 * pages`` units) into
    device pages ``pages .. 2*pages-1`` on ``load`` with the DSA indexer
    page-row copy (``dsa_indexer_per_layer``, one warp per page row); the
    ``forward`` stream runs ``compute_us`` of indexer projection and reads
    those pages, without waiting on the layer event unless ``gated``."""
    bpt, ept, pages, scale = p["bytes_per_token"], p["page_tokens"], p["pages"], p["scale_bytes"]
    if bpt <= scale:
        raise InputError("bytes_per_token", f"expected more than scale_bytes={scale} (the key bytes of a "
                         f"token are bytes_per_token - scale_bytes), got {bpt}")
    row = bpt * ept
    if row % 8:
        raise InputError("bytes_per_token", f"expected bytes_per_token x page_tokens to be a multiple of 8 "
                         f"(the kernel copy moves 8-byte words; SGLang takes the direct path otherwise), "
                         f"got {bpt} x {ept} = {row}")
    fields = [{"name": "key", "offset": 0, "entry_bytes": bpt - scale}]
    if scale:
        fields.append({"name": "scale", "offset": ept * (bpt - scale), "entry_bytes": scale})
    tokens = pages * ept
    args = {"layer": 0, "src_indices": {"start": 0, "count": tokens},
            "dst_indices": {"start": tokens, "count": tokens}}
    if ept != 64:
        args["page_size"] = ept
    ops = [
        {"id": "start_event", "op": "record", "stream": "forward", "event": "start_loading"},
        {"op": "wait", "stream": "load", "event": "start_loading"},
        {"id": "load_index_k_L0", "op": "copy", "stream": "load", "routine": "dsa_indexer_per_layer",
         "src": "host_index_k", "dst": "dev_index_k", "args": args},
        {"id": "complete_L0", "op": "record", "stream": "load", "event": "layer0_loaded"},
        {"id": "indexer_q_proj", "op": "compute", "stream": "forward", "duration_us": p["compute_us"]},
    ]
    if p["gated"]:
        ops.append({"id": "wait_until_L0", "op": "wait", "stream": "forward", "event": "layer0_loaded"})
    ops.append({"id": "indexer_read_index_k_L0", "op": "read", "stream": "forward", "buffer": "dev_index_k",
                "layer": 0, "units": {"start": pages, "count": pages}})
    return {
        "kvrace_schedule": 2,
        "name": f"minimal_race_b{bpt}_p{pages}_c{p['compute_us']:g}{'_gated' if p['gated'] else ''}",
        "description": (f"Read of {pages} index-K pages ({ept} tokens x {bpt} B) after {p['compute_us']:g} us "
                        f"of compute, {'gated on' if p['gated'] else 'racing'} their host-to-device load."),
        "buffers": [
            {"name": "host_index_k", "location": "host", "kind": "index_k",
             "layout": {"kind": "host", "layout": "layer_first", "layers": 1, "units": 2 * pages,
                        "unit_bytes": row},
             "init": [{"layers": "all", "indices": {"start": 0, "count": pages}, "owner": 12, "version": 1,
                       "first_unit": 0}]},
            {"name": "dev_index_k", "location": "device", "kind": "index_k",
             "layout": {"kind": "paged", "name": "index_k", "layers": 1, "pages": 2 * pages, "page_bytes": row,
                        "entries_per_page": ept, "fields": fields}},
        ],
        "streams": ["forward", "load"],
        "events": ["start_loading", "layer0_loaded"],
        "ops": ops,
    }


minimal_race = register(Generator(
    "minimal_race",
    "the missing wait_layer_transfer race of examples/index_k_ungated_race.json: an index-K read after "
    "compute_us of compute, racing the host-to-device load of the pages it reads",
    (
        Param("bytes_per_token", int, 132, "index-K bytes per token (132: DSA fp8 keys + fp32 scale; "
              "256: a bf16 index-K)", minimum=1),
        Param("pages", int, 4, "pages loaded (and read)", minimum=1),
        Param("page_tokens", int, 64, "tokens per page", minimum=1),
        Param("scale_bytes", int, 4, "bytes of each token's scale, stored after the page's keys (0: none)",
              minimum=0),
        Param("compute_us", float, 3.0, "compute on the forward stream before the read (us)", minimum=0.0),
        Param("gated", bool, False, "the fixed variant: the read waits on the layer event"),
        Param("launch_jitter_us", float, None, "the profile's device.launch_jitter_us for this point",
              minimum=0.0),
    ),
    _minimal_race_doc,
    derived=lambda p: {"load_bytes": p["bytes_per_token"] * p["page_tokens"] * p["pages"]},
    reads=("indexer_read_index_k_L0",),
    x="bytes_per_token",
    lines="compute_us",
))
