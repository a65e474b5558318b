"""Benchmarks for steplib: per-step overhead against a raw PyTorch loop and against the peers.

Run ``python -m benchmarks.bench_overhead`` from the repository root (see notes/README).
"""
