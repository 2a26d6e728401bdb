"""Benchmarks behind ``ptxtrain bench``: every backend and baseline timed in one process.

Method (docs/design.md §6): CUDA events around single calls, the L2 flushed before each call, host
launch overhead hidden behind a device-side sleep queued ahead of the start event, warm-up first,
median of the timed repeats. Results are printed as a table with ratios to the baselines and written
as JSON (device, versions, git sha, date, shapes, numbers) for ``benchmarks/results/``.
"""
