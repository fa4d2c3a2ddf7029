"""Benchmark suite for flash_dmattn: ``python -m benchmarks.run --help``.

Modules:

* :mod:`benchmarks.workloads` - the shapes of each suite and how their inputs are built;
* :mod:`benchmarks.impls` - flash_dmattn backends and the baselines (SDPA, FlexAttention);
* :mod:`benchmarks.timing` - median timing and peak-memory measurement;
* :mod:`benchmarks.report` - JSON, markdown and PNG output;
* :mod:`benchmarks.run` - the command line that ties them together.
"""
