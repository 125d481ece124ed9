"""The cost model, in seconds and bytes: ``model.CostModel`` (the one object the search and the
evaluator price with), ``links``, ``compute``, ``layer_time``, ``memory``, ``stage`` and ``step``.
Imports run one way, from the terms up to the model (the terms take the model as ``cm``), so
this package's ``__init__`` imports nothing."""
