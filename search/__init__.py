"""The search: the cost model, the uniform baseline, the CP-SAT planner and plan evaluation.

Imports partita, numpy and ortools only — never torch.
"""
