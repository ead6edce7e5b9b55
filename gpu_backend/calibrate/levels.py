"""What a calibration level measures (``LEVELS``: full, quick, smoke) and the constants shared by the
calibration modules."""
from __future__ import annotations

from dataclasses import dataclass


KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
#: bytes one DSv4 token moves per layer (576 B value + 8 B scale)
DSV4_TOKEN_BYTES = 584
#: the hicache-family routine whose builtin H2D copies set the profile's link parameters
LINK_ROUTINE = "kernel_per_layer"


Shapes = tuple  # ((item_bytes, (n_items, ...)), ...)


@dataclass(frozen=True)
class Level:
    """What one calibration level measures.  ``kpl``/``d2h``/``sglang_kpl``: ``kernel_per_layer``
    shapes as ``((item_bytes, (n_items, ...)), ...)``."""

    name: str
    reps: int
    warmup: int
    memcpy_bytes: tuple[int, ...]
    kpl: Shapes
    dsv4_items: tuple[int, ...]
    d2h: Shapes
    sglang_kpl: Shapes
    spin_cycles: tuple[int, ...]
    spin_requested_us: tuple[float, ...]
    hbm_bytes: int


#: index-K pages of 64 tokens at 64, 128, 256, 512 and 1,024 key bytes per token (+ 4 B scale)
INDEX_K_PAGES = tuple(64 * (k + 4) for k in (64, 128, 256, 512, 1024))
_SMALL_N = (1, 4, 16, 64, 128, 512, 2048, 8192, 16384)
_LARGE_N = (1, 4, 16, 64, 128, 512, 2048)

LEVELS = {
    "full": Level("full", 15, 3,
                  tuple(8 * KIB << k for k in range(16)),
                  ((256, _SMALL_N), (576, _SMALL_N), (1152, _SMALL_N),
                   *((b, _SMALL_N if b <= 8448 else _LARGE_N) for b in INDEX_K_PAGES)),
                  (1, 32, 256, 1024, 4096, 8448, 16384, 32768),
                  ((1152, (64, 1024, 8192)), (8448, (4, 64, 1024, 8192))),
                  ((1152, _SMALL_N), (8448, _SMALL_N), (33024, _LARGE_N)),
                  (0, 1000, 10_000, 100_000, 1_000_000, 4_000_000),
                  (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
                  GIB),
    "quick": Level("quick", 7, 2,
                   (8 * KIB, 64 * KIB, 512 * KIB, 4 * MIB, 32 * MIB, 256 * MIB),
                   ((1152, (1, 16, 64, 512, 4096)), (8448, (1, 16, 64, 512, 4096)), (33024, (1, 16, 64, 512))),
                   (1, 256, 4096, 16384),
                   ((8448, (4, 64, 512, 4096)),),
                   (),
                   (0, 10_000, 1_000_000),
                   (5, 20, 100, 500),
                   256 * MIB),
    # the GPU test's level: seconds, every code path once
    "smoke": Level("smoke", 3, 1,
                   (8 * KIB, 4 * MIB), ((1152, (1, 64, 512)), (8448, (1, 64, 512))), (1, 256, 4096),
                   ((8448, (64,)),), (), (0, 100_000), (20, 100), 64 * MIB),
}


def _shape_bytes(shapes: Shapes) -> list[int]:
    return [n * 5 // 4 * b for b, counts in shapes for n in counts]
