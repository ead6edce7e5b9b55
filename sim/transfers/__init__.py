"""Copy routines as byte-exact extent maps, and when their bytes land."""
from sim.transfers.routines import (  # noqa: F401
    ROUTINES, CopyPlan, Extents, Launch, OutOfBounds, Routine, check_bounds, plan,
)
from sim.transfers.timing import LinkTiming, bytes_done, item_times  # noqa: F401
