"""The profiler: measure per-layer compute and memory, and collective costs, on real devices.

    partita profile --model tiny-llama --device cpu --micro-batches 1,16 -o prof.yaml
    partita profile --comm-only --device cpu --nproc 4 -o comm.yaml
    python -m partita.cli.profile --model llama-3-8b --device cuda --tp 1,2,4,8 -o h200.yaml

Modules: ``layers`` (time and memory of one layer shard), ``comm`` (collectives over ranks),
``attention`` (the attention core alone), ``fit`` (pure numpy). The command (flags, progress
bars, the tables, measured against analytic) is the app's: ``partita.cli.profile``. Reading a
profile at any micro-batch is ``partita.profile.layer_cost_at``, beside the schema, so the search
never imports this package.
This package's ``__init__`` imports nothing.
"""
