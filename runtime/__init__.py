"""The runtime: torch models, applying a plan with torch.distributed, the training loop.

Imports torch; ``partita`` and ``partita.search`` never import this package.
"""
