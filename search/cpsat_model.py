"""The CP-SAT model of one shape (``PlanModel``): its variables and constraint families, the
hint, and reading a layout back. ``search/cpsat.py`` states the model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from ortools.sat.python import cp_model

from partita.plan import LayerStrategy, gives_whole
from partita.search.cpsat_fit import StageFit, _hull_cuts
from partita.search.cpsat_problem import Problem
from partita.search.uniform import Layout

# ---- the model ----------------------------------------------------------------------------
class PlanModel:
    """Variables and one method per constraint family (labels as in the module docstring)."""

    def __init__(self, p: Problem, upper_bound_us: int | None, fit: "StageFit | None" = None) -> None:
        self.p = p
        self.tied = p.tied
        self.pipeline = p.pipeline
        self.fit = fit
        self.m = cp_model.CpModel()
        K, G = p.slots, len(p.groups)
        nb, ne, nh = len(p.block.strategies), len(p.embed.strategies), len(p.head.strategies)
        m = self.m
        self.y = [[m.new_bool_var(f"y[{r},{g}]") for g in range(G)] for r in range(K)]  # slot r on group g
        self.used = [m.new_bool_var(f"used[{r}]") for r in range(K)]
        # A subproblem's choices that are not allowed are fixed to zero.
        self.c = [[[m.new_int_var(0, p.n_blocks if p.block.allows(g, k) else 0, f"c[{r},{g},{k}]") for k in range(nb)]
                   for g in range(G)] for r in range(K)]
        self.e = [[[m.new_bool_var(f"e[{r},{g},{k}]") for k in range(ne)] for g in range(G)] for r in range(K)]
        self.h = [[m.new_bool_var(f"h[{g},{k}]") for k in range(nh)] for g in range(G)]
        for g in range(G):
            m.add_bool_and([self.e[r][g][k].Not() for r in range(K) for k in range(ne) if not p.embed.allows(g, k)])
            m.add_bool_and([self.h[g][k].Not() for k in range(nh) if not p.head.allows(g, k)])
        self.u = [[m.new_bool_var(f"u[{r},{k}]") for k in range(nb)] for r in range(K)]  # strategy k used in slot r
        # The longest a stage can take: every layer at its slowest choice, plus its sides of two
        # boundaries (transfers and end gathers).
        most = lambda t: max(max(row) for row in t.time_us)  # noqa: E731
        horizon = (p.n_blocks * most(p.block) + most(p.embed) + most(p.head) + 2 * max(max(r) for r in p.p2p_us)
                   + 2 * max(p.gather_us, default=0))
        self.T = [m.new_int_var(0, horizon, f"T[{r}]") for r in range(K)]
        self.T_max = m.new_int_var(0, horizon, "T_max")
        self.E = m.new_int_var(0, horizon, "exposed_dp")
        # The largest stage edge, per micro-batch, within a subproblem's level (``edge_levels``).
        top = horizon if p.edge_ceiling_us is None else p.edge_ceiling_us
        self.Z = m.new_int_var(p.edge_floor_us, top, "zero_edge") if top > p.edge_floor_us else top
        self.O = m.new_int_var(0, horizon, "optimizer")
        self.upper_bound_us = upper_bound_us

    def build(self) -> None:
        self.add_stage_fit_cuts()
        self.add_slot_placement()
        self.add_pipeline_zero()
        self.add_group_capacity()
        self.add_block_cover()
        self.add_embed_and_head()
        self.add_stage_time()
        self.add_memory()
        self.add_data_parallel_and_optimizer()
        self.add_objective()

    def _block_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        p = self.p
        return sum(table[g][k] * self.c[r][g][k] for g in range(len(p.groups)) for k in range(len(p.block.strategies)))

    def _embed_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        return sum(table[g][k] * self.e[r][g][k] for g in range(len(self.p.groups)) for k in range(len(self.p.embed.strategies)))

    def _head_sum(self, r: int, table: tuple[tuple[int, ...], ...]) -> cp_model.LinearExpr:
        if r != 0:
            return 0
        return sum(table[g][k] * self.h[g][k] for g in range(len(self.p.groups)) for k in range(len(self.p.head.strategies)))

    # (F) redundant cuts from the stage-fit relaxation (see StageFit): a slot's time is at
    # least the convex least-time curve of its block count on its group, and no slot takes
    # more blocks than fit its memory. They are proven valid and give the LP a tight bound.
    def add_stage_fit_cuts(self) -> None:
        if self.fit is None:
            return
        p = self.p
        nb = len(p.block.strategies)
        # The element constraints pay on one group; on several the hull cuts alone are cheaper,
        # and they come from the curves the search computed (the envelope's unless it tightened
        # them: ``ShapeSearch._tighten``).
        whole = len(p.groups) == 1
        if whole:
            self.fit.tighten()
        for r in range(p.slots):
            for g in range(len(p.groups)):
                f = self.fit.curves_any[g, r]  # whatever the slot's place: valid for every one
                finite = np.nonzero(np.isfinite(f))[0]
                most = int(finite[-1])  # the most blocks that fit
                n_on_g = self.m.new_int_var(0, most, f"n[{r},{g}]")
                self.m.add(n_on_g == sum(self.c[r][g][k] for k in range(nb)))
                self.m.add(n_on_g <= most * self.y[r][g])
                if whole:
                    # CP propagation: the slot's time is at least the curve at its block count,
                    # the curve of its place: the first stage (slot 0: the only one) or another.
                    nxt = self.used[r + 1] if r + 1 < p.slots else None
                    for first in (True, False):
                        if nxt is None and not first:
                            continue
                        curve = self.fit.integer_curve(r, g, first=first)[:most + 1]
                        top = max(int(v) for v in curve if np.isfinite(v))
                        least = self.m.new_int_var(0, top, f"least[{r},{g},{first}]")
                        self.m.add_element(n_on_g, [int(math.floor(v)) if np.isfinite(v) else top for v in curve], least)
                        cond = self.y[r][g] if nxt is None else ([self.y[r][g], nxt.Not()] if first else [self.y[r][g], nxt])
                        self.m.add(self.T[r] >= least).only_enforce_if(cond)
                        if not all(np.isfinite(curve)):  # counts this place cannot hold
                            bad = [n for n, v in enumerate(curve) if not np.isfinite(v)]
                            self.m.add_linear_expression_in_domain(
                                n_on_g, cp_model.Domain.from_values([n for n in range(most + 1) if n not in bad])
                            ).only_enforce_if(cond)
                # LP: the lower convex hull of the curve, as linear cuts through (0, 0).
                for slope, intercept in _hull_cuts(f[:most + 1]):
                    self.m.add(self.T[r] >= int(math.floor(slope)) * n_on_g + int(math.floor(intercept)) * self.y[r][g])

    # (P) each used slot sits on exactly one group; used slots are a prefix from the end of
    # the pipeline (r = 0 is the last stage), which also breaks the symmetry of empty slots.
    def add_slot_placement(self) -> None:
        for r in range(self.p.slots):
            self.m.add(sum(self.y[r]) == self.used[r])
            if r > 0:
                self.m.add_implication(self.used[r], self.used[r - 1])
        self.m.add(self.used[0] == 1)
        if self.pipeline:  # the user pinned the pipeline degrees allowed
            self.m.add_linear_expression_in_domain(sum(self.used), cp_model.Domain.from_values(list(self.pipeline)))

    # (Z) the ZeRO levels the engine runs (``parallel.pipeline_zero_rule``): once a second slot is
    # used, no layer takes a level outside ``p.pipelined_zeros``; while one is, outside
    # ``p.unpipelined_zeros``.
    def add_pipeline_zero(self) -> None:
        p = self.p
        if p.slots >= 2:
            self._bar_zeros(self.used[1], p.pipelined_zeros)
            self._bar_zeros(self.used[1].Not(), p.unpipelined_zeros)
        else:
            self._bar_zeros(None, p.unpipelined_zeros)

    def _bar_zeros(self, when, zeros: tuple[int, ...]) -> None:
        """No layer takes a ZeRO level outside ``zeros`` whenever the literal ``when`` holds
        (always, for None)."""
        p = self.p

        def bar(var) -> None:
            if when is None:
                self.m.add(var == 0)
            else:
                self.m.add_implication(when, var.Not())

        barred = lambda table: [k for k, s in enumerate(table.strategies) if s.zero not in zeros]  # noqa: E731
        for r in range(p.slots):
            for k in barred(p.block):
                bar(self.u[r][k])
            for g in range(len(p.groups)):
                for k in barred(p.embed):
                    bar(self.e[r][g][k])
        for g in range(len(p.groups)):
            for k in barred(p.head):
                bar(self.h[g][k])

    # (C) a group hosts at most size // S stages.
    def add_group_capacity(self) -> None:
        for g, cap in enumerate(self.p.stages_per_group):
            self.m.add(sum(self.y[r][g] for r in range(self.p.slots)) <= cap)
        if self.p.price_cap is not None:  # the cost objective's bound on the devices used
            self.m.add(sum(price * self.y[r][g] for r in range(self.p.slots)
                           for g, price in enumerate(self.p.stage_price)) <= self.p.price_cap)

    # (B) every block is in exactly one stage; counts only on the slot's group; each used stage
    # holds at least one block; u marks exactly the strategies present in a slot (the boundary
    # gathers read a slot's end blocks from it).
    def add_block_cover(self) -> None:
        p = self.p
        G, nb = len(p.groups), len(p.block.strategies)
        self.m.add(sum(self.c[r][g][k] for r in range(p.slots) for g in range(G) for k in range(nb)) == p.n_blocks)
        for r in range(p.slots):
            for g in range(G):
                self.m.add(sum(self.c[r][g]) <= p.n_blocks * self.y[r][g])
            self.m.add(sum(self.c[r][g][k] for g in range(G) for k in range(nb)) >= self.used[r])
            for k in range(nb):
                self.m.add(sum(self.c[r][g][k] for g in range(G)) <= p.n_blocks * self.u[r][k])
                self.m.add(sum(self.c[r][g][k] for g in range(G)) >= self.u[r][k])

    # (E) the embedding sits on the first stage (the highest used slot), the head on the last.
    def add_embed_and_head(self) -> None:
        p = self.p
        G = len(p.groups)
        for r in range(p.slots):
            first = self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0)
            self.m.add(sum(self.e[r][g][k] for g in range(G) for k in range(len(p.embed.strategies))) == first)
            for g in range(G):
                for k in range(len(p.embed.strategies)):
                    self.m.add_implication(self.e[r][g][k], self.y[r][g])
        for g in range(G):
            self.m.add(sum(self.h[g]) == self.y[0][g])
        self.alone = None
        if p.head.copy_transient_bytes:  # a tied head keeps a copy when the pipeline has several stages
            self.alone = self.m.new_bool_var("alone")  # one stage: the last is also the first
            self.m.add(self.alone == self.used[0] - (self.used[1] if p.slots > 1 else 0))
        if self.tied:  # one weight: the runtime needs the same tensor split and ZeRO level for both
            key = lambda s: (s.tensor_parallel, s.zero)  # noqa: E731
            for choice in {key(s) for s in p.embed.strategies} | {key(s) for s in p.head.strategies}:
                embed = [self.e[r][g][k] for r in range(p.slots) for g in range(G)
                         for k, s in enumerate(p.embed.strategies) if key(s) == choice]
                head = [self.h[g][k] for g in range(G) for k, s in enumerate(p.head.strategies) if key(s) == choice]
                self.m.add(sum(embed) == sum(head))

    # (T) stage time: its layers and its side of each boundary: the send to the next stage (slot
    # r - 1) and the gradient back, the receive from the stage before (slot r + 1) and its
    # gradient, and the all-gathers of its end blocks at split boundaries.
    def add_stage_time(self) -> None:
        p = self.p
        boundary = [self._p2p(r) if r > 0 else 0 for r in range(p.slots)]
        for r in range(p.slots):
            expr = self._block_sum(r, p.block.time_us) + self._embed_sum(r, p.embed.time_us) + self._head_sum(r, p.head.time_us)
            if r > 0:  # its side of the boundary to the next stage ...
                expr += boundary[r]
            if r + 1 < p.slots:  # ... and of the one from the stage before (nothing when that slot is unused)
                expr += boundary[r + 1]
            expr += self._end_gathers(r)
            self.m.add(self.T[r] == expr)
            self.m.add(self.T_max >= self.T[r])

    def _end_gathers(self, r: int) -> cp_model.LinearExprT:
        """The all-gathers slot r's end blocks run at split boundaries (``costs.stage.boundary_gathers``):
        its first block when it receives (the slot after it is used), its last when it sends
        (r > 0), each when that block is not sequence-parallel. A slot's blocks are in the
        canonical order of its group (``LayerTable.order``), so its first block is the earliest
        strategy it uses in that order and its last the latest: a boolean per end and group,
        forced to 1 when a whole-layout strategy is used and none before it (after it) is."""
        p = self.p
        G = len(p.groups)
        whole = {k for k, s in enumerate(p.block.strategies) if gives_whole(s.tensor_parallel, s.sequence_parallel)}
        if not whole or not any(p.gather_us):
            return 0
        ends = []
        if r + 1 < p.slots:
            ends.append(("first", self.used[r + 1]))
        if r > 0:
            ends.append(("last", self.used[r]))
        terms = []
        for g in range(G):
            if not p.gather_us[g]:
                continue
            order = list(p.block.order[g]) if p.block.order else list(range(len(p.block.strategies)))
            for end, active in ends:
                seq = order if end == "first" else order[::-1]
                gathers = self.m.new_bool_var(f"gather_{end}[{r},{g}]")
                for i, k in enumerate(seq):
                    if k in whole:
                        self.m.add(gathers + sum(self.u[r][j] for j in seq[:i]) >= 1).only_enforce_if(
                            [self.u[r][k], self.y[r][g], active])
                terms.append(p.gather_us[g] * gathers)
        return sum(terms)

    def _at_least_each_layer(self, var: cp_model.IntVar, r: int, field: str) -> None:
        """var >= ``field`` of every layer slot r holds, on the group it sits on (the objective
        grows with var, so the solver sets it to the largest)."""
        p = self.p
        G = len(p.groups)
        tables = [getattr(t, field) for t in (p.block, p.embed, p.head)]
        for g in range(G):
            for k, v in enumerate(tables[0][g]):
                if v:
                    self.m.add(var >= v).only_enforce_if([self.u[r][k], self.y[r][g]])
            for k, v in enumerate(tables[1][g]):
                if v:
                    self.m.add(var >= v * self.e[r][g][k])
            if r == 0:
                for k, v in enumerate(tables[2][g]):
                    if v:
                        self.m.add(var >= v * self.h[g][k])

    def _p2p(self, r: int) -> cp_model.LinearExpr:
        """Send cost between slot r and slot r - 1, through pair booleans w[g][h] = y[r][g] and y[r-1][h]."""
        p = self.p
        G = len(p.groups)
        if G == 1:  # one group: the send costs the same wherever the stage is
            return p.p2p_us[0][0] * self.used[r]
        terms = []
        for g in range(G):
            for h in range(G):
                w = self.m.new_bool_var(f"w[{r},{g},{h}]")
                self.m.add_bool_and([self.y[r][g], self.y[r - 1][h]]).only_enforce_if(w)
                self.m.add_bool_or([self.y[r][g].Not(), self.y[r - 1][h].Not(), w])
                terms.append(p.p2p_us[g][h] * w)
        return sum(terms)

    # (M) per device memory, in grains as the evaluator counts it (``costs.stage._stage_cost``): static
    # state + k - 1 micro-batches' activations + the stage outputs kept + the schedule's extra +
    # the running micro-batch at each of its layers (the activations of the layers up to it, in
    # the canonical order, plus its transient), within the group's capacity less the reserve.
    def add_memory(self) -> None:
        p = self.p
        G, nb = len(p.groups), len(p.block.strategies)
        ne, nh = len(p.embed.strategies), len(p.head.strategies)
        m_count = p.shape.num_micro_batches
        for r in range(p.slots):
            k_in_flight = min(r + 1, m_count)
            extra = self._stage_extra(r)
            for g in range(G):
                static = sum(p.block.static_bytes[g][k] * self.c[r][g][k] for k in range(nb))
                embed_acts = sum(p.embed.act_bytes[g][k] * self.e[r][g][k] for k in range(ne))
                acts = sum(p.block.act_bytes[g][k] * self.c[r][g][k] for k in range(nb)) + embed_acts
                static += sum(p.embed.static_bytes[g][k] * self.e[r][g][k] for k in range(ne))
                if r == 0:
                    static += sum(p.head.static_bytes[g][k] * self.h[g][k] for k in range(nh))
                    acts += sum(p.head.act_bytes[g][k] * self.h[g][k] for k in range(nh))
                # Every stage but the last keeps its output per micro-batch in flight.
                out = p.output_bytes if r > 0 else 0
                base = static + (k_in_flight - 1) * acts + k_in_flight * out + extra
                cap = p.capacity_bytes[g]
                self.m.add(base + acts <= cap).only_enforce_if(self.y[r][g])
                for k in range(ne):
                    if p.embed.transient_bytes[g][k]:
                        self.m.add(base + p.embed.act_bytes[g][k] + p.embed.transient_bytes[g][k] <= cap
                                   ).only_enforce_if(self.e[r][g][k])
                prefix = embed_acts
                for k in p.block.order[g]:
                    prefix = prefix + p.block.act_bytes[g][k] * self.c[r][g][k]
                    if p.block.transient_bytes[g][k]:
                        self.m.add(base + prefix + p.block.transient_bytes[g][k] <= cap
                                   ).only_enforce_if([self.u[r][k], self.y[r][g]])
                if r == 0:
                    copy = p.head.copy_transient_bytes  # a tied head's copy when the embedding is elsewhere
                    for k in range(nh):
                        if copy:
                            self.m.add(base + acts + p.head.transient_bytes[g][k] <= cap
                                       ).only_enforce_if([self.h[g][k], self.alone])
                            self.m.add(base + acts + copy[g][k] <= cap).only_enforce_if([self.h[g][k], self.alone.Not()])
                        elif p.head.transient_bytes[g][k]:
                            self.m.add(base + acts + p.head.transient_bytes[g][k] <= cap).only_enforce_if(self.h[g][k])

    def _stage_extra(self, r: int) -> cp_model.LinearExprT:
        """The bytes the schedule adds to slot r (see Problem.extra_*), by its group, whether it
        is the first stage, and for the last one (r = 0) its head's choice."""
        p = self.p
        G = len(p.groups)
        if not p.extra_first:
            return 0
        values = [v for row in (p.extra_first, p.extra_middle) for v in row]
        values += [v for t in (p.extra_last, p.extra_alone) for row in t for v in row]
        if not any(values):
            return 0
        var = self.m.new_int_var(min(0, min(values)), max(0, max(values)), f"stage_extra[{r}]")
        first = self.m.new_bool_var(f"first[{r}]")  # slot r holds the first stage
        self.m.add(first == self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0))
        for g in range(G):
            if r > 0:
                self.m.add(var >= p.extra_first[g]).only_enforce_if([self.y[r][g], first])
                self.m.add(var >= p.extra_middle[g]).only_enforce_if([self.y[r][g], first.Not()])
            else:
                for k in range(len(p.head.strategies)):
                    self.m.add(var >= p.extra_alone[g][k]).only_enforce_if([self.h[g][k], first])
                    self.m.add(var >= p.extra_last[g][k]).only_enforce_if([self.h[g][k], first.Not()])
        return var

    # (D) exposed data-parallel sync (what sticks out of the overlap window of a stage's last
    # backward, and at least its largest layer's reduction), the exposed ZeRO edge (a stage's
    # largest layer's per-micro-batch ZeRO traffic, charged m times in the objective) and the
    # optimizer step, each the maximum over stages.
    def add_data_parallel_and_optimizer(self) -> None:
        p = self.p
        for r in range(p.slots):
            sync = self._block_sum(r, p.block.sync_us) + self._embed_sum(r, p.embed.sync_us) + self._head_sum(r, p.head.sync_us)
            window = (self._block_sum(r, p.block.window_us) + self._embed_sum(r, p.embed.window_us)
                      + self._head_sum(r, p.head.window_us))
            self.m.add(self.E >= sync - window)
            self._at_least_each_layer(self.E, r, "sync_us")  # the last reduction hides behind nothing
            if not isinstance(self.Z, int):
                self._at_least_each_layer(self.Z, r, "edge_us")
            opt = (self._block_sum(r, p.block.optimizer_us) + self._embed_sum(r, p.embed.optimizer_us)
                   + self._head_sum(r, p.head.optimizer_us))
            self.m.add(self.O >= opt)
        # A tied head on its own stage: the copies' gradient sum and the copy's update, per step.
        self.tied_sync = 0
        if p.head.tied_us and any(v for row in p.head.tied_us for v in row):
            top = max(v for row in p.head.tied_us for v in row)
            self.tied_sync = self.m.new_int_var(0, top, "tied_sync")
            for g in range(len(p.groups)):
                for k, v in enumerate(p.head.tied_us[g]):
                    if v:
                        self.m.add(self.tied_sync >= v).only_enforce_if([self.h[g][k], self.alone.Not()])

    # (O) the 1F1B step time; bounded by the incumbent so only better plans are searched.
    def add_objective(self) -> None:
        m_count = self.p.shape.num_micro_batches
        self.objective = ((m_count - 1) * self.T_max + sum(self.T) + m_count * self.Z + self.E + self.O + self.tied_sync
                          + self.p.step_overhead_us)
        if self.upper_bound_us is not None:
            self.m.add(self.objective <= self.upper_bound_us)
        self.m.add(self.objective >= self.p.lower_bound_us)
        if self.fit is not None:
            # Redundant, proven by the stage-fit relaxation; they give the LP its bound at once:
            # the slowest stage of a pipeline pp deep is at least tau*(pp) (slot pp - 1 is the
            # first stage exactly when it is used and the next is not).
            p = self.p
            for r in range(p.slots):
                first = self.used[r] - (self.used[r + 1] if r + 1 < p.slots else 0)
                tau = self.fit.least_slowest_stage_at_us(r + 1)
                if math.isfinite(tau):
                    self.m.add(self.T_max >= int(math.floor(tau)) * first)
                else:
                    self.m.add(first == 0)  # this depth cannot hold the model
            self.m.add(self.objective >= self.fit.bound_us())
        self.m.minimize(self.objective)

    # ---- hint and read-back -----------------------------------------------------------------
    def add_hint(self, layout: Layout) -> None:
        """Feed a plan of this shape (the uniform best) as the solver's starting point."""
        p = self.p
        pp = layout.pp
        if pp > p.slots:
            return
        gi = {g.name: i for i, g in enumerate(p.groups)}
        for r in range(p.slots):
            s = pp - 1 - r  # forward stage index of slot r
            self.m.add_hint(self.used[r], s >= 0)
            for g in range(len(p.groups)):
                on = s >= 0 and gi.get(layout.stage_groups[s].name) == g
                self.m.add_hint(self.y[r][g], on)
                for k, strat in enumerate(p.block.strategies):
                    n = 0
                    if on:
                        n = sum(1 for l in layout.stage_layers[s] if l.name.startswith("layers.") and _same(l, strat))
                    self.m.add_hint(self.c[r][g][k], n)
                for k, strat in enumerate(p.embed.strategies):
                    self.m.add_hint(self.e[r][g][k], on and s == 0 and _same(layout.stage_layers[0][0], strat))
        for g in range(len(p.groups)):
            last = layout.stage_layers[-1][-1]
            for k, strat in enumerate(p.head.strategies):
                self.m.add_hint(self.h[g][k], gi.get(layout.stage_groups[-1].name) == g and _same(last, strat))

    def read_layout(self, solver: cp_model.CpSolver) -> Layout:
        p = self.p
        G = len(p.groups)
        used = [r for r in range(p.slots) if solver.value(self.used[r])]
        pp = len(used)
        stage_groups, stage_layers = [], []
        next_block = 0
        for s in range(pp):
            r = pp - 1 - s
            g = next(g for g in range(G) if solver.value(self.y[r][g]))
            layers: list[LayerStrategy] = []
            if s == 0:
                k = next(k for g2 in range(G) for k in range(len(p.embed.strategies)) if solver.value(self.e[r][g2][k]))
                layers.append(dataclasses.replace(p.embed.strategies[k], name="embed"))
            for k in p.block.order[g]:
                strat = p.block.strategies[k]
                for _ in range(solver.value(self.c[r][g][k])):
                    layers.append(dataclasses.replace(strat, name=f"layers.{next_block}"))
                    next_block += 1
            if r == 0:
                k = next(k for k in range(len(p.head.strategies)) if solver.value(self.h[g][k]))
                layers.append(dataclasses.replace(p.head.strategies[k], name="head"))
            stage_groups.append(p.groups[g])
            stage_layers.append(tuple(layers))
        sh = p.shape
        return Layout(stage_groups=tuple(stage_groups), stage_layers=tuple(stage_layers), dp=sh.dp, tp=sh.tp,
                      micro_batch=sh.micro_batch, num_micro_batches=sh.num_micro_batches)


def _same(a: LayerStrategy, b: LayerStrategy) -> bool:
    return (a.tensor_parallel, a.sequence_parallel, a.zero, a.recompute) == (
        b.tensor_parallel, b.sequence_parallel, b.zero, b.recompute)
