"""kvrace GPU backend: replays the simulator's copies on a real GPU and returns its bytes.

Imports ``sim`` (layouts, routines, schedules, ``sim.report_io``), never the other way round, and
never the command line (``kvrace.cli`` imports this package, only for ``replay`` and
``calibrate``).  Its exceptions derive from ``sim.errors.KvraceError``.  Torch and the
kernel toolchains are imported lazily, so ``import gpu_backend`` works on a machine without them.
"""
