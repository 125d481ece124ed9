"""Partita: plan and run large-model training across (mixed) GPU clusters.

``partita`` holds the specs shared by the three stages (model, cluster, device catalog,
profile, plan), their files and validation, and the CLI. It never imports torch.
"""

__version__ = "0.1.0"
