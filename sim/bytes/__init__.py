"""Bytes and provenance: pattern bytes, and the compact and materialised buffer models."""
from sim.bytes.compact import CompactBuffer, OriginTable, Pieces, pattern_runs
from sim.bytes.describe import describe, describe_text
from sim.bytes.material import MaterialBuffer
from sim.bytes.pattern import Origin, decode_words, pattern_bytes

__all__ = ["CompactBuffer", "MaterialBuffer", "Origin", "OriginTable", "Pieces", "decode_words",
           "describe", "describe_text", "pattern_bytes", "pattern_runs"]
