"""kvrace: the command line (``kvrace.cli``) over the simulator (``sim``) and the GPU backend
(``gpu_backend``).  The library API is ``sim``'s ``__all__``; ``kvrace.cli.main(argv)`` runs a
command in-process and returns its exit code."""
from sim import __version__  # noqa: F401  (one version for the distribution)
