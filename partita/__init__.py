"""Partita: plan and run large-model training across (mixed) GPU clusters.

``partita`` holds the core shared by the three stages: the specs (model, cluster, device
catalog, profile, plan and its mesh), their files, the rules, validation, units and errors. It
imports only numpy and PyYAML, never torch; the command is the app above it, ``partita.cli``.
"""

__version__ = "0.1.0"
