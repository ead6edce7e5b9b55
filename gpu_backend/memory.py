"""GPU and pinned-host buffers with guard regions, filled with the simulator's bytes.

Every buffer is one allocation laid out as ``[guard before | logical bytes | guard after]``.
Both guards are filled with a canary: 8-byte words that name the buffer (its ordinal in the
:class:`BufferSet`), the side and the word's position, so a word copied out of another
buffer's guard or out of pattern bytes never looks like this guard's canary.  A copy that
writes past either end of the logical bytes lands in a guard, and :meth:`BufferSet.check_guards`
reports which guard bytes changed instead of corrupting a neighbour.  A write further out than
the guard is not caught: size ``guard_bytes`` above the largest overrun you expect.

Host buffers are pinned (``pin_memory=True``), so the kernels reach them through unified
addressing at the tensor's own pointer, as SGLang's kernel I/O backend does with its
``cudaHostRegister``-ed host pool.

The canary and the guard diff are plain numpy (``canary_words``, ``diff_guard``); only
:class:`BufferSet` needs torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_GUARD_BYTES = 64 * 1024
_CANARY_TAG = np.uint64(0xC5 << 56)
SIDES = ("before", "after")


def canary_words(ordinal: int, side: str, nwords: int) -> np.ndarray:
    """The canary of one guard: ``nwords`` uint64 words.

    Word ``k`` encodes (ordinal < 2**15, side, k < 2**32) seven bits per byte in bytes 0..6,
    each byte with its top bit set, and the tag 0xC5 in byte 7: unique per buffer, side and
    position, and never a zero byte (the commonest byte a stray write stores).
    """
    if side not in SIDES:
        raise ValueError(f"guard side: expected one of {SIDES}, got {side!r}")
    if not 0 <= ordinal < (1 << 15):
        raise ValueError(f"buffer ordinal: expected 0..32767, got {ordinal}")
    if not 0 <= nwords < (1 << 32):
        raise ValueError(f"guard words: expected 0..2**32-1, got {nwords}")
    info = (np.uint64(ordinal << 33) | np.uint64(SIDES.index(side) << 32)
            | np.arange(nwords, dtype=np.uint64))
    word = np.full(nwords, _CANARY_TAG, dtype=np.uint64)
    for b in range(7):
        seven = (info >> np.uint64(7 * b)) & np.uint64(0x7F)
        word |= (seven | np.uint64(0x80)) << np.uint64(8 * b)
    return word


def canary_bytes(ordinal: int, side: str, nbytes: int) -> np.ndarray:
    """The canary of one guard as ``nbytes`` bytes (``nbytes`` a multiple of 8)."""
    if nbytes % 8:
        raise ValueError(f"guard bytes: expected a multiple of 8, got {nbytes}")
    return canary_words(ordinal, side, nbytes // 8).astype("<u8").view(np.uint8)


@dataclass(frozen=True)
class GuardReport:
    """What changed in one guard.

    Offsets are relative to the logical buffer: for ``after`` the first byte past the end is
    offset 0; for ``before`` the byte just before the start is offset -1.  ``words_changed``
    counts 8-byte words that differ from the canary (the kernels move whole words, so
    ``8 * words_changed`` is the bytes a copy wrote there even where a written byte happens to
    equal the canary's); ``bytes_changed`` counts bytes that differ.
    """

    buffer: str
    side: str
    bytes_changed: int
    words_changed: int
    first_offset: int
    last_offset: int

    def __str__(self) -> str:
        where = "past the end" if self.side == "after" else "before the start"
        return (f"buffer {self.buffer!r}: {self.bytes_changed} guard bytes changed "
                f"({self.words_changed} words) {where}, offsets {self.first_offset}..{self.last_offset}")


def diff_guard(buffer: str, side: str, expected: np.ndarray, got: np.ndarray) -> GuardReport | None:
    """Compare a guard's bytes with its canary; None when nothing changed."""
    if expected.shape != got.shape:
        raise ValueError(f"guard of {buffer!r} ({side}): expected {expected.size} bytes, got {got.size}")
    changed = np.flatnonzero(expected != got)
    if changed.size == 0:
        return None
    n = expected.size
    words = np.unique(changed // 8).size
    if side == "after":
        first, last = int(changed[0]), int(changed[-1])
    else:
        first, last = int(changed[0]) - n, int(changed[-1]) - n
    return GuardReport(buffer, side, int(changed.size), int(words), first, last)


@dataclass
class Buffer:
    """One guarded allocation: ``tensor`` is the uint8 view of the logical bytes, ``ptr`` its
    address (a device pointer, or a pinned host pointer usable from the device)."""

    name: str
    ordinal: int
    location: str
    nbytes: int
    guard_bytes: int
    allocation: object   # the whole torch tensor, guards included
    tensor: object       # the logical bytes
    ptr: int


class BufferSet:
    """Named guarded buffers on one CUDA device and its pinned host memory.

    ``device`` is a torch device ("cuda", "cuda:1"; "cpu" puts "device" buffers in ordinary
    memory for tests without a GPU, and host buffers are then not pinned).
    """

    def __init__(self, device="cuda", guard_bytes: int = DEFAULT_GUARD_BYTES):
        import torch

        if guard_bytes < 0 or guard_bytes % 256:
            raise ValueError(f"guard_bytes: expected a non-negative multiple of 256, got {guard_bytes}")
        self.torch = torch
        self.device = torch.device(device)
        self.guard_bytes = guard_bytes
        self._buffers: dict[str, Buffer] = {}

    def add(self, name: str, nbytes: int, location: str, data: np.ndarray | None = None) -> Buffer:
        """Allocate ``nbytes`` logical bytes on "device" or "host", filled with ``data``
        (uint8, ``nbytes`` long; zeros when None), guards filled with canaries."""
        torch = self.torch
        if name in self._buffers:
            raise ValueError(f"buffer {name!r}: already allocated; expected a new name")
        if location not in ("device", "host"):
            raise ValueError(f"buffer {name!r} location: expected 'device' or 'host', got {location!r}")
        if nbytes <= 0:
            raise ValueError(f"buffer {name!r} nbytes: expected > 0, got {nbytes}")
        g = self.guard_bytes
        ordinal = len(self._buffers)
        whole = np.empty(g + nbytes + g, dtype=np.uint8)
        whole[:g] = canary_bytes(ordinal, "before", g)
        whole[g + nbytes:] = canary_bytes(ordinal, "after", g)
        whole[g:g + nbytes] = 0 if data is None else self._check_data(name, nbytes, data)
        src = torch.from_numpy(whole)
        if location == "device":
            alloc = src.to(self.device)
        else:
            pin = self.device.type == "cuda"
            alloc = torch.empty(whole.size, dtype=torch.uint8, pin_memory=pin)
            alloc.copy_(src)
        view = alloc[g:g + nbytes]
        buf = Buffer(name, ordinal, location, nbytes, g, alloc, view, int(view.data_ptr()))
        self._buffers[name] = buf
        return buf

    @staticmethod
    def _check_data(name: str, nbytes: int, data: np.ndarray) -> np.ndarray:
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != nbytes:
            raise ValueError(f"buffer {name!r} data: expected a 1-D uint8 array of {nbytes} bytes, "
                             f"got dtype {data.dtype} shape {data.shape}")
        return data

    def __getitem__(self, name: str) -> Buffer:
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r}; buffers: {sorted(self._buffers)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def __iter__(self):
        return iter(self._buffers.values())

    def names(self) -> list[str]:
        return list(self._buffers)

    def write(self, name: str, data: np.ndarray) -> None:
        """Overwrite a buffer's logical bytes (synchronously)."""
        buf = self[name]
        data = self._check_data(name, buf.nbytes, data)
        buf.tensor.copy_(self.torch.from_numpy(np.ascontiguousarray(data)))

    def read(self, name: str) -> np.ndarray:
        """A buffer's logical bytes as a numpy uint8 array (synchronises the device)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        return self[name].tensor.cpu().numpy().copy()

    def _whole(self, buf: Buffer) -> np.ndarray:
        return buf.allocation.cpu().numpy()

    def check_guards(self) -> list[GuardReport]:
        """One report per guard whose bytes changed (empty when all canaries are intact)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        reports = []
        for buf in self._buffers.values():
            whole = self._whole(buf)
            g, n = buf.guard_bytes, buf.nbytes
            for side, got in (("before", whole[:g]), ("after", whole[g + n:])):
                r = diff_guard(buf.name, side, canary_bytes(buf.ordinal, side, g), got)
                if r is not None:
                    reports.append(r)
        return reports

    def guard_bytes_of(self, name: str, side: str) -> np.ndarray:
        """The current bytes of one guard (for tests that model what an overrun wrote)."""
        buf = self[name]
        whole = self._whole(buf)
        g, n = buf.guard_bytes, buf.nbytes
        return whole[:g].copy() if side == "before" else whole[g + n:].copy()
