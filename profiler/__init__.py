"""The profiler: measure per-layer compute and memory, and collective costs, on real devices.

    partita profile --model tiny-llama --device cpu --micro-batches 1,16 -o prof.yaml
    partita profile --comm-only --device cpu --nproc 4 -o comm.yaml
    python -m partita.profiler --model llama-3-8b --device cuda --tp 1,2,4,8 -o h200.yaml

Modules: ``layers`` (time and memory of one layer shard), ``comm`` (collectives over ranks),
``fit`` and ``interpolate`` (pure numpy, no torch: the search imports ``interpolate``),
``cli`` (flags and the command). This package's ``__init__`` imports nothing, so that
``partita.profiler.interpolate`` can be imported where torch is not installed.
"""
