"""Load ``sglang.jit_kernel`` modules without running SGLang's top-level ``__init__`` when it
cannot run here.

Why: ``import sglang`` imports the server (frontend language, HF patches, many optional
dependencies).  The copy kernels kvrace needs (``sglang.jit_kernel.hisparse``,
``sglang.jit_kernel.hicache``) need only torch, apache-tvm-ffi and a compiler.  On a machine with
the bare sglang wheel and none of the server's dependencies the top-level import fails although
the kernels would build.

What it does, in order (``import_jit_module``):

1. ``importlib.import_module("sglang.jit_kernel.<name>")``, the normal way.  When that works the
   shim does nothing else: on a full SGLang install it steps aside completely (mode "package").
2. If the *top-level* ``sglang`` package failed to import, every ``sglang``/``sglang.*`` entry
   that the failed attempt left in ``sys.modules`` is removed and a bare package module is
   registered as ``sys.modules["sglang"]``: a ``types.ModuleType`` whose ``__path__`` is the
   installed package directory (``importlib.util.find_spec("sglang")``, which locates the
   package without executing it) and whose ``__spec__`` is that spec.  Submodules then import
   from the real files as usual; only ``sglang/__init__.py`` is skipped.
3. ``sglang.jit_kernel.utils`` does ``from sglang.utils import is_in_ci``, and ``sglang/utils.py``
   imports notebook and HTTP packages (IPython, pybase64, pydantic).  If that module cannot be
   imported, a module named ``sglang.utils`` is registered holding just ``is_in_ci``, which reads
   ``envs.SGLANG_IS_IN_CI`` from the real ``sglang.srt.environ`` (standard library only), as the
   original does.  Nothing else is replaced.

The shim never edits installed files, and it changes ``sys.modules`` only when step 1 failed on
the top-level import.  ``SHIM_STATE[package]`` records what it did for that package: mode
("package" or "shim"), why the top-level import failed, stand-ins registered.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from sim.errors import KvraceError

SHIM_STATE: dict[str, dict] = {}


def _state(package: str) -> dict:
    return SHIM_STATE.setdefault(package, {"mode": None, "reason": "", "stand_ins": []})


class ShimError(KvraceError, ImportError):
    """The kernels could not be imported even without the top-level package."""


def _drop_modules(package: str, keep: set[str]) -> None:
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        if key not in keep:
            del sys.modules[key]


def _register_bare_package(package: str) -> types.ModuleType:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ShimError(f"package {package!r} is not installed (importlib.util.find_spec found no "
                        f"package directory on sys.path); expected an installed {package} wheel")
    mod = types.ModuleType(package, f"bare {package} package registered by kvrace's sglang_shim")
    mod.__path__ = list(spec.submodule_search_locations)
    mod.__spec__ = spec
    mod.__file__ = spec.origin
    mod.__package__ = package
    mod.__kvrace_bare__ = True
    sys.modules[package] = mod
    return mod


def _register_utils_stand_in(package: str) -> None:
    """``<package>.utils`` holding only ``is_in_ci`` (what ``jit_kernel.utils`` imports)."""
    environ = importlib.import_module(f"{package}.srt.environ")
    utils = types.ModuleType(f"{package}.utils",
                             f"kvrace stand-in: {package}.utils could not be imported; "
                             "holds only is_in_ci, read from srt.environ as the original does")

    def is_in_ci() -> bool:
        return environ.envs.SGLANG_IS_IN_CI.get()

    utils.is_in_ci = is_in_ci
    sys.modules[utils.__name__] = utils
    setattr(sys.modules[package], "utils", utils)
    _state(package)["stand_ins"].append(utils.__name__)


def import_jit_module(name: str, package: str = "sglang") -> types.ModuleType:
    """``<package>.jit_kernel.<name>``, importing the full package if it can, else through the
    bare package (module docstring)."""
    target = f"{package}.jit_kernel.{name}"
    bare = sys.modules.get(package)
    if bare is not None and getattr(bare, "__kvrace_bare__", False):
        return _import_under_bare(target, package)
    before = set(sys.modules)
    try:
        mod = importlib.import_module(target)
        _state(package).update(mode="package", reason="")
        return mod
    except Exception as exc:   # the top-level __init__ may raise anything, not only ImportError
        if package in sys.modules:
            raise   # the package itself imported: the failure is in the kernels; nothing to shim
        _state(package)["reason"] = f"import {package} failed: {type(exc).__name__}: {exc}"
    _drop_modules(package, keep=before)
    _register_bare_package(package)
    _state(package)["mode"] = "shim"
    return _import_under_bare(target, package)


def _import_under_bare(target: str, package: str) -> types.ModuleType:
    try:
        importlib.import_module(f"{package}.utils")
    except ImportError:
        _drop_modules(f"{package}.utils", keep=set())
        _register_utils_stand_in(package)
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise ShimError(f"{target} failed to import even without {package}'s top-level __init__ "
                        f"({_state(package)['reason']}): {type(exc).__name__}: {exc}; expected torch, "
                        "apache-tvm-ffi and the sglang wheel to be installed") from exc
