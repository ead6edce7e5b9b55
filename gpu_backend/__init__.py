"""kvrace GPU backend: replays the simulator's copies on a real GPU and returns its bytes.

Imports ``sim`` (layouts, routines, schedules), never the other way round; torch and the
kernel toolchains are imported lazily, so ``import gpu_backend`` works on a machine without them.
"""
