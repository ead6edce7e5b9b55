"""kvrace simulator: byte-exact buffers, copy routines, CUDA stream/event semantics.

Runs on numpy, simpy and networkx alone (no torch).
"""
__version__ = "0.1.0"
