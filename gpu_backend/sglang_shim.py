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
   original does, or, when ``srt`` is not installed either, the environment variable with the
   same parsing.  ``sglang.jit_kernel.hicache`` imports ``debug_kernel_api`` from
   ``sglang.kernel_api_logging``; if that cannot be imported, a stand-in whose decorator returns
   the function unchanged is registered.  Nothing else is replaced.
4. Where only ``sglang/jit_kernel`` is installed (the package imports, e.g. as a namespace
   package, but ``sglang.utils`` or ``sglang.kernel_api_logging`` is missing), the package is
   kept and only those stand-ins are added.

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


#: the values SGLang's ``EnvBool`` reads as true / false (``srt/environ.py``)
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def _env_flag(name: str) -> bool:
    """An ``EnvBool`` flag read from the environment as SGLang reads it (unset or invalid:
    False, its default for ``SGLANG_IS_IN_CI``)."""
    import os

    v = os.environ.get(name)
    return v is not None and v.lower() in _TRUE


def _register_utils_stand_in(package: str) -> None:
    """``<package>.utils`` holding only ``is_in_ci`` (what ``jit_kernel.utils`` imports):
    read from ``srt.environ`` as the original does, or, where only ``jit_kernel`` is
    installed, from the environment with ``EnvBool``'s parsing."""
    try:
        environ = importlib.import_module(f"{package}.srt.environ")
        read = environ.envs.SGLANG_IS_IN_CI.get
    except ImportError:
        def read() -> bool:
            return _env_flag("SGLANG_IS_IN_CI")
    utils = types.ModuleType(f"{package}.utils",
                             f"kvrace stand-in: {package}.utils could not be imported; "
                             "holds only is_in_ci, read as the original does")

    def is_in_ci() -> bool:
        return read()

    utils.is_in_ci = is_in_ci
    _register(package, utils)


def _register_logging_stand_in(package: str) -> None:
    """``<package>.kernel_api_logging`` holding only ``debug_kernel_api``, which ``jit_kernel``
    modules use as a decorator (``@debug_kernel_api`` or ``@debug_kernel_api(op_name=...)``);
    the stand-in returns the function unchanged (SGLang's, with its logging off, adds nothing
    either)."""
    mod = types.ModuleType(f"{package}.kernel_api_logging",
                           f"kvrace stand-in: {package}.kernel_api_logging could not be imported; "
                           "debug_kernel_api returns the function unchanged")

    def debug_kernel_api(func=None, *, op_name=None):
        return func if func is not None else (lambda f: f)

    mod.debug_kernel_api = debug_kernel_api
    _register(package, mod)


def _register(package: str, mod: types.ModuleType) -> None:
    sys.modules[mod.__name__] = mod
    setattr(sys.modules[package], mod.__name__.rsplit(".", 1)[1], mod)
    _state(package)["stand_ins"].append(mod.__name__)


#: the modules of ``<package>`` a ``jit_kernel`` module imports that the shim can stand in for
_STAND_INS = (("utils", _register_utils_stand_in), ("kernel_api_logging", _register_logging_stand_in))


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
        standable = {f"{package}.{name}" for name, _ in _STAND_INS}
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if package in sys.modules and missing not in standable:
            raise   # the package itself imported: the failure is in the kernels; nothing to shim
        _state(package)["reason"] = f"import {target} failed: {type(exc).__name__}: {exc}"
    if package in sys.modules:
        # NOTE: only jit_kernel is installed (the package imports, e.g. as a namespace package,
        # but a module the kernels import is missing): keep the package, stand in for the module
        _drop_modules(package, keep=before | {package})
        sys.modules[package].__kvrace_bare__ = True
    else:
        _drop_modules(package, keep=before)
        _register_bare_package(package)
    _state(package)["mode"] = "shim"
    return _import_under_bare(target, package)


def _import_under_bare(target: str, package: str) -> types.ModuleType:
    for name, stand_in in _STAND_INS:
        if f"{package}.{name}" in sys.modules:
            continue
        try:
            importlib.import_module(f"{package}.{name}")
        except ImportError:
            _drop_modules(f"{package}.{name}", keep=set())
            stand_in(package)
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise ShimError(f"{target} failed to import even without {package}'s top-level __init__ "
                        f"({_state(package)['reason']}): {type(exc).__name__}: {exc}; expected torch, "
                        "apache-tvm-ffi and the sglang wheel to be installed") from exc
