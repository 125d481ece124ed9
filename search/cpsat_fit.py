"""Stage-fit bounds of the CP-SAT planner (``StageFit``): how fast a shape's stages can be at
best within their memory, by the LP envelope and the whole-block knapsack curves; the proofs
and bounds that prune shapes before CP-SAT and the cuts it is given."""

from __future__ import annotations

import math

import numpy as np

from partita.search.cpsat_problem import NEVER, Problem

# The knapsack's "does not fit" in 32-bit integer microseconds: no finite sum comes near it.
KNAPSACK_NEVER = 1 << 30

# How much the whole-block curves raise the least slowest stage above the envelope's at most,
# for the search to compute them (``StageFit.may_prune_tight``): on the instances of
# benchmarks/search_targets.py they raised it by 0-2.8 % of the stage budget (measured by a
# one-off script), so a shape whose budget the envelope meets with 5 % to spare is not pruned by
# them, and CP-SAT refutes it as fast with the envelope's cuts (the 1,024-GPU three-type
# instance: 53 shapes, none pruned by the curves, CP-SAT's time the same either way).
TIGHTEN_SLACK = 0.05


def _hull(mem: np.ndarray, time_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower convex envelope of (memory, time) points, memory increasing, time non-increasing:
    the least average time per block for any average memory per block (fractional mixes)."""
    order = np.lexsort((time_, mem))
    pts: list[tuple[float, float]] = []
    for x, y in zip(mem[order], time_[order]):
        if pts and y >= pts[-1][1]:
            continue  # more memory and no faster: never on the envelope
        while len(pts) >= 2 and (pts[-1][1] - pts[-2][1]) * (x - pts[-2][0]) >= (y - pts[-2][1]) * (pts[-1][0] - pts[-2][0]):
            pts.pop()
        pts.append((float(x), float(y)))
    xs, ys = zip(*pts)
    return np.array(xs), np.array(ys)


def _hull_cuts(f: np.ndarray) -> list[tuple[float, float]]:
    """Lines (slope, intercept) of the lower convex hull of points (n, f[n]), n = 0..len-1.
    Each lies below every point, and the intercept is <= f[0] = 0."""
    hull: list[tuple[int, float]] = []
    for n, v in enumerate(f):
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (n - hull[-2][0]) >= (v - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append((n, float(v)))
    cuts = []
    for (n0, v0), (n1, v1) in zip(hull, hull[1:]):
        slope = (v1 - v0) / (n1 - n0)
        cuts.append((slope, v0 - slope * n0))
    return cuts


def pipeline_reach(most: np.ndarray, caps: tuple[int, ...], keep: bool = False,
                   allowed: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """The most blocks a pipeline of each depth holds, each of its stages on one group and group
    g hosting at most ``caps[g]`` of them: ``reach[t, depth]`` (-1: none), for stages that take
    at most ``most[t, r, g, place]`` blocks in slot r on group g (place 1: the first stage, the
    deepest slot used; 0: any other) and at least one. A programme over slots whose state is the
    number of stages used on each group; ``states[r]`` (kept with ``keep``, for the first t) is
    the most blocks slots 0..r-1 hold, none of them the first stage. ``allowed`` (a boolean per
    state, ``price_states``) leaves out the states a pipeline may not reach: the cost
    objective's devices over its price bound."""
    T, K, G = most.shape[0], most.shape[1], most.shape[2]
    shape = (T,) + tuple(min(c, K) + 1 for c in caps)
    V = np.full(shape, -1, dtype=np.int64)
    V[(slice(None),) + (0,) * G] = 0
    states = [V[0]] if keep else []
    reach = np.full((T, K + 1), -1, dtype=np.int64)
    lift = (slice(None),) + (None,) * G  # a [t] vector against the state axes
    for r in range(K):
        nxt = np.full(shape, -1, dtype=np.int64)
        done = np.full(T, -1, dtype=np.int64)
        for g in range(G):
            src, dst = [slice(None)] * (G + 1), [slice(None)] * (G + 1)
            src[g + 1], dst[g + 1] = slice(0, -1), slice(1, None)
            prev = V[tuple(src)]
            if allowed is not None:  # the state a stage on g leads to must be allowed
                prev = np.where(allowed[tuple(dst[1:])][None], prev, -1)
            add = most[:, r, g, 1][lift]
            done = np.maximum(done, np.where((prev >= 0) & (add >= 1), prev + add, -1).reshape(T, -1).max(axis=1, initial=-1))
            if r + 1 < K:
                add = most[:, r, g, 0][lift]
                np.maximum(nxt[tuple(dst)], np.where((prev >= 0) & (add >= 1), prev + add, -1), out=nxt[tuple(dst)])
        reach[:, r + 1] = done
        V = nxt
        if keep:
            states.append(V[0])
    return states, reach


def price_states(p: Problem, caps: tuple[int, ...], slots: int) -> np.ndarray | None:
    """[stages on each group]: whether a pipeline of up to ``slots`` stages with that many on
    each group costs at most the cost objective's price bound (``Problem.price_cap``); None
    without one. The states of ``pipeline_reach`` for the same caps and slots."""
    if p.price_cap is None:
        return None
    axes = np.meshgrid(*[np.arange(min(c, slots) + 1) for c in caps], indexing="ij")
    price = sum(n * int(p.stage_price[g]) for g, n in enumerate(axes))
    return np.asarray(price <= p.price_cap)


def _slot_floor(p: Problem, r: int, k: int) -> int:
    """Memory any stage in slot r holds besides its layers' own terms, whatever the pipeline's
    depth: a used slot r >= 1 is not the last stage, so the schedule keeps its gradient receive
    buffers and its output per micro-batch in flight (``pipeline_memory``)."""
    return p.receive_bytes + k * p.output_bytes if r >= 1 else 0


class StageFit:
    """Whether a shape's stages can hold all blocks with no stage slower than tau.

    With pp stages, stage r (from the end) keeps k = min(r + 1, m) micro-batches in flight, so
    on group g its n blocks may use at most room_g / n memory each on average; the least time
    for them is at first n x the (memory, time) envelope of the block's choices at that average
    (the LP relaxation of the stage), and after ``tighten`` the whole-block curves
    (``integer_curve``). Stages are counted per group up to the group's share.
    This yields proofs (``prunes``) and bounds (``bound_us``) that account for memory, which
    the plain work bound does not.
    """

    def __init__(self, p: Problem, shared: dict | None = None) -> None:
        self.p = p
        self.m = p.shape.num_micro_batches
        # Whole-block curves by slot, group and the choices allowed there: one shape's
        # subproblems (``edge_levels``) share them where their choices agree.
        self._int = {} if shared is None else shared
        N = p.n_blocks
        self.least_embed = p.embed.least("time_us")
        self.least_head = p.head.least("time_us")
        self.least_p2p = min(min(r) for r in p.p2p_us)
        self.work = N * p.block.least("time_us") + self.least_embed + self.least_head
        # The objective's terms no slowest stage or work bound holds: a subproblem's edge m x Z,
        # the step overhead, and the least exposed sync and optimizer step any block brings (the
        # exposed sync is at least every layer's own reduction, the optimizer step at least one
        # block's).
        self.fixed = (self.m * p.edge_floor_us + p.step_overhead_us + p.block.least("sync_us")
                      + p.block.least("optimizer_us"))
        # [group, slot, blocks]: least stage time of its blocks, for a slot holding the first
        # stage (slot 0: the only one), for one that does not, and for either. First the cheap
        # fractional envelope (``_envelope``), then, for shapes it does not prune, the whole-block
        # curves (``tighten``).
        self.curves = self._envelope(first=True)
        self.curves_not_first = self._envelope(first=False)
        self.curves_any = np.minimum(self.curves, self.curves_not_first)
        self.tight = False

    def tighten(self) -> None:
        """Replace the envelope by the whole-block curves (``integer_curve``); bounds are recomputed."""
        if self.tight:
            return
        p, G = self.p, len(self.p.groups)
        self.curves = np.array([[self.integer_curve(r, g, first=True) for r in range(p.slots)] for g in range(G)])
        self.curves_not_first = np.array([[self.integer_curve(r, g, first=False) for r in range(p.slots)]
                                          for g in range(G)])
        self.curves_any = np.minimum(self.curves, self.curves_not_first)
        self.tight = True
        self.__dict__.pop("_tau", None)
        self.__dict__.pop("_tau_at", None)

    def _envelope(self, *, first: bool) -> np.ndarray:
        """Least time of n blocks in each (group, slot) when blocks may mix choices fractionally:
        n x the (memory, time) envelope of the allowed choices at the slot's room / n (the LP
        relaxation of the stage; transients left out). ``first``: a slot that may hold the first
        stage; otherwise (tighter) one that keeps its activation receive buffers."""
        p, N = self.p, self.p.n_blocks
        n = np.arange(1, N + 1, dtype=float)
        head_room = p.head.least("static_bytes")
        recv = 0 if first else p.receive_bytes
        rows = []
        for g in range(len(p.groups)):
            row = []
            allowed = p.block.on(g)
            for r in range(p.slots):
                k = min(r + 1, self.m)
                if not allowed:
                    row.append(np.concatenate([[0.0], np.full(N, np.inf)]))
                    continue
                mem = np.array([p.block.static_bytes[g][j] + k * p.block.act_bytes[g][j] for j in allowed], float)
                xs, ys = _hull(mem, np.array([p.block.time_us[g][j] for j in allowed], float))
                room = p.capacity_bytes[g] - (head_room if r == 0 else 0) - _slot_floor(p, r, k) - recv
                per_block = room / n
                avg = np.interp(per_block, xs, ys)  # beyond the last point: the fastest choice
                avg[per_block < xs[0]] = np.inf  # not even the leanest choice fits
                row.append(np.concatenate([[0.0], n * avg]))
            rows.append(np.stack(row))
        return np.stack(rows)

    def integer_curve(self, r: int, g: int, grain_steps: int = 4096, *, first: bool | None = None) -> np.ndarray:
        """Least time of n = 0..N whole blocks in slot r on group g within its memory (blocks
        may mix choices), by dynamic programming over a memory grid; inf where n blocks cannot
        fit. A lower bound on the slot's block time, as tight as two of the memory rows (M) allow:

        - at the last layer in the canonical order (the used choice of least transient, j):
          static + k x activations of every block + j's transient;
        - at the first (the used choice of largest transient, h): static + (k - 1) x every
          block's activations + h's own activations (at least one block's) + h's transient;

        each beside the least the slot holds whatever its layers (its place's schedule extra,
        outputs in flight, a last stage's head). ``first`` says whether the slot holds the
        first stage (for slot 0: the only one), None either. Each row is a knapsack over the choices a
        prefix of the canonical order allows, solved for every prefix in one pass; the curve is
        the larger of the two rows' least times. Memory and room are rounded down to whole grid
        cells (the sum of rounded-down weights is at most the rounded-down sum), so the curve
        stays a lower bound."""
        p, N = self.p, self.p.n_blocks
        b = p.block
        order = [j for j in (b.order[g] if b.order else range(len(b.strategies))) if b.allows(g, j)]
        k = min(r + 1, self.m)
        # A slot past the first enters only by its micro-batches in flight (k): the slots from
        # m - 1 on share one curve.
        cache, at = self._int, (r == 0, k, g, tuple(order), tuple(p.head.on(g)))
        if (*at, first) in cache:
            return cache[(*at, first)]
        places = (True, False)
        rooms = [p.capacity_bytes[g] - self._slot_least_bytes(r, g, k, place) for place in places]
        if not order:
            curves = [np.concatenate([[0.0], np.full(N, np.inf)]) for _ in places]
        else:
            times = [float(t) for t in b.time_us[g]]
            tr = b.transient_bytes[g]
            full = [b.static_bytes[g][j] + k * b.act_bytes[g][j] for j in range(len(times))]
            lean = [b.static_bytes[g][j] + (k - 1) * b.act_bytes[g][j] for j in range(len(times))]
            head = 0
            if r == 0 and p.head.transient_bytes:  # the head's own moment, after every block
                head = min((p.head.act_bytes[g][h] + p.head.transient_bytes[g][h] for h in p.head.on(g)), default=NEVER)
            # Per place: the last layer's row (and the head's: the prefix of every choice), then the first's.
            last = self._knapsack(order, full, times, [[room - max(tr[j], head) for j in order] for room in rooms],
                                  grain_steps)
            lead = self._knapsack(order[::-1], lean, times,
                                  [[room - b.act_bytes[g][j] - tr[j] for j in order[::-1]] for room in rooms], grain_steps)
            curves = [np.maximum(a, c) for a, c in zip(last, lead)]
        for place, curve in zip(places, curves):
            curve[0] = 0.0
            cache[(*at, place)] = curve
        cache[(*at, None)] = np.minimum(*curves)
        return cache[(*at, first)]

    def _slot_least_bytes(self, r: int, g: int, k: int, first: bool | None = None) -> int:
        """Memory slot r on group g holds besides its blocks' static state and activations at
        any moment, at its place in the pipeline (``first``: the first stage, or for slot 0 the
        only one; None: either) whatever its head's choice: the schedule's extra, the outputs in
        flight, the head's state and activations (slot 0)."""
        p = self.p
        pick = lambda a, b: {True: a, False: b, None: min(a, b)}[first]  # noqa: E731
        if r == 0:
            h = p.head
            least = min((h.static_bytes[g][j] + (k - 1) * h.act_bytes[g][j]
                         + (pick(p.extra_alone[g][j], p.extra_last[g][j]) if p.extra_last else 0)
                         for j in h.on(g)), default=NEVER)
        else:
            least = k * p.output_bytes + (pick(p.extra_first[g], p.extra_middle[g]) if p.extra_first else 0)
        return max(least, _slot_floor(p, r, k) + (p.head.least("static_bytes") if r == 0 else 0))

    def _knapsack(self, order: list[int], weight: list[int], times: list[float], rooms: list[list[int]],
                  grain_steps: int) -> list[np.ndarray]:
        """Least time of n = 0..N blocks whose choices come from a prefix of ``order``, within
        that prefix's room (``rooms[i]`` once ``order[i]`` is allowed), the least over prefixes:
        an unbounded knapsack with a count dimension, one pass over the choices, read for each
        list of rooms given."""
        N = self.p.n_blocks
        outs = [np.full(N + 1, np.inf) for _ in rooms]
        top = max(max(rs) for rs in rooms)
        if top <= 0:
            return outs
        grain = max(1.0, top / grain_steps)
        cells = int(top // grain)
        ws = {j: int(weight[j] // grain) for j in order}  # rounded down: never heavier than the block
        lightest = max(1, min(ws.values()))
        most = min(N, cells // lightest)  # no more blocks than the lightest choice fits
        # Whole microseconds, summed exactly in 32-bit integers (half the memory traffic of
        # floats) while no sum can reach ``never``; floats otherwise.
        slowest = max(times[j] for j in order)
        exact = all(float(times[j]).is_integer() for j in order) and (most + 1) * slowest < KNAPSACK_NEVER
        never = KNAPSACK_NEVER if exact else np.inf
        best = np.full((most + 1, cells + 1), never, dtype=np.int32 if exact else float)  # n blocks within c cells
        best[0, :] = 0
        step = np.empty(cells + 1, dtype=best.dtype)
        for i, j in enumerate(order):
            w = ws[j]
            if w <= cells:
                t = int(times[j]) if exact else times[j]
                for n in range(1, most + 1):  # n ascending: the same choice may repeat
                    lo = max(w, n * lightest)  # below n lightest blocks' cells nothing fits
                    if lo > cells:
                        break
                    tmp = step[:cells + 1 - lo]
                    np.add(best[n - 1, lo - w:cells + 1 - w], t, out=tmp)
                    np.minimum(best[n, lo:], tmp, out=best[n, lo:])
            for out, rs in zip(outs, rooms):
                if rs[i] >= 0:
                    col = best[:, min(cells, int(rs[i] // grain))]
                    if exact:
                        col = np.where(col >= never, np.inf, col)
                    np.minimum(out[:most + 1], col, out=out[:most + 1])
        return outs

    def holds(self, pp: int, tau: float, *, empty_slots: bool = False) -> bool:
        """Can pp stages hold every block with none slower than tau? With ``empty_slots``,
        slots may stay unused (and the embedding's stage is not known): a relaxation of every
        depth up to pp at once. Each slot takes its best group and each group its best slots,
        apart (``holds_exact`` places them together)."""
        p = self.p
        fit = self._fit(pp, tau, empty_slots)
        if empty_slots:
            fit = np.maximum(fit, 0)
        any_group = int(fit.max(axis=0).sum())
        per_group = sum(int(np.sort(fit[g])[::-1][:p.stages_per_group[g]].sum()) for g in range(len(p.groups)))
        return min(any_group, per_group) >= p.n_blocks

    def holds_exact(self, pp: int, tau: float) -> bool:
        """``holds`` with the slots placed on groups together (``pipeline_reach``): each stage
        on one group, holding at least one block, within the group's number of stages."""
        fit = self._fit(pp, tau, False)  # [g, r]
        most = np.zeros((1, pp, len(self.p.groups), 2), dtype=np.int64)
        most[0, :pp - 1, :, 0] = fit[:, :pp - 1].T
        most[0, pp - 1, :, 1] = fit[:, pp - 1]
        caps = self.p.stages_per_group
        return pipeline_reach(most, caps, allowed=price_states(self.p, caps, pp))[1][0, pp] >= self.p.n_blocks

    def holds_within_price(self) -> bool:
        """Can some pipeline whose devices cost at most the cost objective's price bound hold
        every block in memory at all (``holds_exact`` at no time bound, every depth)? True
        without a price bound; False is a proof that the shape has no plan within it. Kept per
        state of the curves (``tighten`` may turn it False)."""
        if self.p.price_cap is None:
            return True
        cache = self.__dict__.setdefault("_within_price", {})
        if self.tight not in cache:
            cache[self.tight] = any(self.holds_exact(pp, math.inf) for pp in range(1, self.p.slots + 1))
        return cache[self.tight]

    def _fit(self, pp: int, tau: float, empty_slots: bool) -> np.ndarray:
        """[group, slot]: the most blocks each slot of a pipeline pp deep takes within tau."""
        stage = (self.curves_any if empty_slots else self.curves)[:, :pp].copy()
        if not empty_slots:  # the first stage is slot pp - 1; every other one receives activations
            stage[:, :pp - 1] = self.curves_not_first[:, :pp - 1]
        stage[:, 1:] += self.least_p2p  # a used slot r >= 1 sends to slot r - 1 ...
        if not empty_slots:  # ... and every stage but the first pays its side of the boundary before it
            stage[:, :pp - 1] += self.least_p2p
        stage[:, 0] += self.least_head
        if not empty_slots:
            stage[:, pp - 1] += self.least_embed
        return np.count_nonzero(stage <= tau, axis=2) - 1  # blocks each (group, slot) takes within tau

    def _floor(self, pp: int) -> float:
        return self.work + self.fixed + 2 * (pp - 1) * self.least_p2p  # each boundary is paid on both sides

    def prunes(self, incumbent_us: int) -> bool:
        """True if no plan of this shape can beat the incumbent."""
        if self.m == 1:
            return self.work + self.fixed >= incumbent_us
        taus = {pp: (incumbent_us - self._floor(pp)) / (self.m - 1)
                for pp in range(1, self.p.slots + 1) if incumbent_us >= self._floor(pp)}
        # The cheap test first; the depths it cannot refute get the exact placement.
        return not any(self.holds(pp, tau) and self.holds_exact(pp, tau) for pp, tau in taus.items())

    def may_prune_tight(self, incumbent_us: int, slack: float = TIGHTEN_SLACK) -> bool:
        """Whether the whole-block curves (``tighten``) may prune where the envelope did not:
        False once some depth holds the blocks within a slowest stage ``slack`` below what
        beating the incumbent allows, a margin the curves do not close."""
        if self.m == 1 or self.tight:
            return not self.tight
        for pp in range(1, self.p.slots + 1):
            floor = self._floor(pp)
            if incumbent_us >= floor and self.holds(pp, (1 - slack) * (incumbent_us - floor) / (self.m - 1)):
                return False
        return True

    def least_slowest_stage_us(self) -> float:
        """tau*(K) with unused slots allowed, a relaxation of every depth up to K at once: no
        plan of the shape has a slowest stage faster than this. inf if nothing holds the model."""
        if not hasattr(self, "_tau"):
            K = self.p.slots
            hi = float(np.max(self.curves[np.isfinite(self.curves)], initial=0.0)) + self.least_head + self.least_embed + self.least_p2p
            lo = 0.0
            if self.holds(K, hi, empty_slots=True):
                for _ in range(24):  # to within hi / 2**24; lo always fails, so it stays a valid bound
                    mid = (lo + hi) / 2
                    lo, hi = (lo, mid) if self.holds(K, mid, empty_slots=True) else (mid, hi)
            else:
                lo = math.inf
            self._tau = lo
        return self._tau

    def least_slowest_stage_at_us(self, pp: int) -> float:
        """tau*(pp): the least slowest-stage time of a pipeline exactly pp deep (its first
        stage holding the embedding); inf if pp stages cannot hold the model."""
        cache = self.__dict__.setdefault("_tau_at", {})
        if pp not in cache:
            hi = float(np.max(self.curves[np.isfinite(self.curves)], initial=0.0)) + self.least_head + self.least_embed + self.least_p2p
            lo = 0.0
            if self.holds(pp, hi):
                for _ in range(24):  # lo always fails: a valid bound
                    mid = (lo + hi) / 2
                    lo, hi = (lo, mid) if self.holds(pp, mid) else (mid, hi)
            else:
                lo = math.inf
            cache[pp] = lo
        return cache[pp]

    def bound_us(self) -> int:
        """(m - 1) * tau*(K) + the least total work, a bound on any plan of the shape."""
        tau = self.least_slowest_stage_us()
        if not math.isfinite(tau):
            return NEVER  # no depth holds the model
        return int(math.floor((self.m - 1) * tau + self.work + self.fixed))
