"""A numpy-backed test double for the few torch names gpu_backend's runner and BufferSet use
on a CPU device, so that their CPU tests run where torch is not installed (CI: the test extra
does not carry torch).  It is NOT torch: it implements exactly what those code paths call
(``device``, ``uint8``/``int16``/``int32``/``int64``, ``from_numpy``, ``empty``, ``zeros``,
``ones``, ``index_select(out=)``, and on tensors slicing (a view), ``view(dtype)``,
``numel``, ``data_ptr``, ``clone``, ``cpu``, ``numpy``, ``to``, ``copy_``, ``index_copy_``),
with torch's semantics for 1-D CPU tensors: ``from_numpy`` and slices share memory,
``view(dtype)`` reinterprets the same bytes, ``to``/``cpu`` on a CPU device return the same
tensor.  ``install(monkeypatch)`` puts it in ``sys.modules["torch"]`` when torch is absent.
"""
from __future__ import annotations

import sys
import types

import numpy as np


class device:
    def __init__(self, spec="cpu", index=None):
        if isinstance(spec, device):
            spec, index = spec.type, spec.index
        kind, _, idx = str(spec).partition(":")
        self.type = kind
        self.index = int(idx) if idx else index

    def __repr__(self):
        return f"device({self.type!r}, {self.index})"


class Tensor:
    def __init__(self, array: np.ndarray):
        self.a = array

    def __getitem__(self, key):
        return Tensor(self.a[key])

    def __setitem__(self, key, value):
        self.a[key] = value.a if isinstance(value, Tensor) else value

    @property
    def dtype(self):
        return self.a.dtype.type

    def numel(self) -> int:
        return int(self.a.size)

    def data_ptr(self) -> int:
        return int(self.a.__array_interface__["data"][0])

    def view(self, dtype) -> "Tensor":
        return Tensor(self.a.view(dtype))

    def clone(self) -> "Tensor":
        return Tensor(self.a.copy())

    def cpu(self) -> "Tensor":
        return self

    def to(self, dev) -> "Tensor":
        if device(dev).type != "cpu":
            raise RuntimeError(f"numpy_torch: only the cpu device exists, got {dev!r}")
        return self

    def numpy(self) -> np.ndarray:
        return self.a

    def copy_(self, src: "Tensor", non_blocking: bool = False) -> "Tensor":
        self.a[...] = src.a
        return self

    def index_copy_(self, dim: int, index: "Tensor", source: "Tensor") -> "Tensor":
        assert dim == 0
        self.a[index.a] = source.a
        return self


def from_numpy(array: np.ndarray) -> Tensor:
    return Tensor(array)


def empty(n, dtype=np.uint8, device=None, pin_memory=False) -> Tensor:
    return Tensor(np.empty(n, dtype=dtype))


def zeros(n, dtype=np.uint8, device=None, pin_memory=False) -> Tensor:
    return Tensor(np.zeros(n, dtype=dtype))


def ones(n, dtype=np.uint8, device=None, pin_memory=False) -> Tensor:
    return Tensor(np.ones(n, dtype=dtype))


def index_select(input: Tensor, dim: int, index: Tensor, out: Tensor) -> Tensor:
    assert dim == 0
    out.a[...] = input.a[index.a]
    return out


def module() -> types.ModuleType:
    m = types.ModuleType("torch")
    m.__doc__ = __doc__
    for name in ("device", "Tensor", "from_numpy", "empty", "zeros", "ones", "index_select"):
        setattr(m, name, globals()[name])
    m.uint8, m.int16, m.int32, m.int64 = np.uint8, np.int16, np.int32, np.int64
    m.IS_NUMPY_TEST_DOUBLE = True
    return m


def install(monkeypatch):
    """Real torch when it imports; otherwise this double, for the duration of one test."""
    try:
        import torch
        return torch
    except ImportError:
        m = module()
        monkeypatch.setitem(sys.modules, "torch", m)
        return m
