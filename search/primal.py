"""A primal heuristic for the CP-SAT planner: a good plan of a shape, built from its cost tables
before CP-SAT runs.

CP-SAT proves that a shape cannot beat a good incumbent far faster than it finds and proves the
shape's own optimum: on the mixed 128-GPU benchmark instance the uniform grid's plan (83.2 s a
step) left every shape to be solved against a weak bound, while with a plan near the optimum
(56.0 s) each shape is refuted in a few hundredths of a work unit. ``shape_plans`` builds such
plans, in three steps, each a lower-level function here:

1. **stage curves** (``slot_table``, ``slot_curve``): for a stage slot r (k = min(r + 1, m) micro-batches in
   flight), a group and a place (first stage or not; slot 0 holds the head), the least time of
   n = 0..N blocks over mixes of at most two block choices whose memory fits exactly as the
   CP-SAT model counts it (family M: static state, k - 1 micro-batches' activations, outputs
   and the schedule's extra, and each used choice's transient at its place in the canonical
   order), with the embedding's and head's choices that make it least. With two choices each
   memory row is linear in the count of the first, so the best split sits at an end of the
   interval the rows allow: computed for every pair and count at once, once per shape, each
   ZeRO-edge subproblem then taking the least of the mixes it allows.
2. **pipeline** (``pipeline_slots``): the least slowest-stage time tau at which some pipeline
   depth and some placement of slots on groups (each within its number of stages) holds every
   block: a dynamic programme over slots and the stages used per group
   (``cpsat_fit.pipeline_reach``), inside a 32-way search over the curves' values. Each
   stage's time counts its boundaries' transfers at the dearest partner group, so it holds
   wherever its neighbours are, and the all-gathers of its mix's end blocks.
3. **blocks** (``deal_blocks``): with the slots placed, the blocks are dealt for the least total
   time with every stage within tau (a min-plus pass over the slots).

The layouts are priced by the evaluator (``evaluate.evaluate_layout``) in ``cpsat.solve_plan``,
which keeps one only if it fits and beats the incumbent: the heuristic proves nothing and
changes no bound, it only finds plans.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from partita.plan import LayerStrategy, gives_whole
from partita.search.cpsat_fit import pipeline_reach, price_states
from partita.search.cpsat_problem import Problem
from partita.search.uniform import Layout

INF = math.inf
# The usage-state space of the pipeline programme (product over groups of stages + 1) times the
# slots: beyond this the heuristic gives up on the shape (such shapes, many narrow stages on
# several groups, are rarely the optimum's, and CP-SAT still searches them).
MAX_STATES = 200_000


@dataclass(frozen=True)
class SlotCurve:
    """Least time of n blocks in one (slot, group, place), and the mix that attains it."""

    time_us: np.ndarray  # [n]: inf where n blocks do not fit (and at n = 0: a stage holds a block)
    embed: np.ndarray  # [n]: the embedding's choice (-1: not the first stage)
    head: np.ndarray  # [n]: the head's choice (-1: not the last stage)
    first: np.ndarray  # [n]: the first block choice (earlier in the canonical order)
    second: np.ndarray  # [n]: the second block choice (-1: one choice only)
    first_count: np.ndarray  # [n]: blocks of the first choice; the rest take the second


@dataclass(frozen=True)
class SlotTable:
    """Every mix of one (slot, group, place) over all of a shape's choices, for its ZeRO-edge
    subproblems to take the least of what each allows (``slot_curve``)."""

    combos: list[tuple[int, int]]  # (embedding choice, head choice); -1: not in this stage
    time_us: np.ndarray  # [combo, mix, n]
    first_count: np.ndarray  # [combo, mix, n]
    first: np.ndarray  # [mix]: its first block choice
    second: np.ndarray  # [mix]: its second (-1: one choice only)


def slot_table(p: Problem, r: int, g: int, first: bool) -> SlotTable:
    """Every one- and two-choice mix of n blocks in slot r on group g at its place (``first``:
    it holds the first stage; slot 0 is also the last) with every embedding and head choice,
    whatever a subproblem allows: the least time of each within the memory the CP-SAT model
    counts (inf where it does not fit)."""
    N = p.n_blocks
    k = min(r + 1, p.shape.num_micro_batches)
    b = p.block
    order = _undominated(p, g, list(b.order[g] if b.order else range(len(b.strategies))))
    embeds, heads = _lean_ends(p, g)
    combos = [(e, h) for e in (embeds if first else [-1]) for h in (heads if r == 0 else [-1])]
    t = np.array([b.time_us[g][j] for j in order], float)
    act = np.array([b.act_bytes[g][j] for j in order], float)
    lean = np.array([b.static_bytes[g][j] for j in order], float) + (k - 1) * act  # L: k - 1 activations
    full = lean + act  # F: all k
    tr = np.array([b.transient_bytes[g][j] for j in order], float)

    # Per (embedding, head) combination: the rooms of the memory rows and the time they add.
    room_all, room_embed, room_base, extra_time = (np.empty(len(combos)) for _ in range(4))
    out = p.output_bytes if r > 0 else 0
    for c, (e, h) in enumerate(combos):
        e_act = p.embed.act_bytes[g][e] if e >= 0 else 0
        h_act = p.head.act_bytes[g][h] if h >= 0 else 0
        const = k * out + (p.embed.static_bytes[g][e] + (k - 1) * e_act if e >= 0 else 0)
        const += p.head.static_bytes[g][h] + (k - 1) * h_act if h >= 0 else 0
        if p.extra_first:  # the schedule's extra at this place (``Problem.extra_*``)
            if r > 0:
                const += p.extra_first[g] if first else p.extra_middle[g]
            else:
                const += (p.extra_alone if first else p.extra_last)[g][h]
        head_need = 0
        if h >= 0:
            copy = p.head.copy_transient_bytes
            head_need = max(0, (p.head.transient_bytes if first or not copy else copy)[g][h])
        cap = p.capacity_bytes[g] - const
        room_all[c] = cap - e_act - h_act - head_need  # every activation (and the head's moment)
        # The embedding's own moment: its activations and transient over the blocks' lean rows.
        room_embed[c] = cap - e_act - p.embed.transient_bytes[g][e] if e >= 0 else INF
        room_base[c] = cap - e_act  # a block's moment: less its prefix's activations and transient
        extra_time[c] = (p.embed.time_us[g][e] if e >= 0 else 0) + (p.head.time_us[g][h] if h >= 0 else 0)

    C, J = len(combos), len(order)
    # No mix of n blocks fits where n of the leanest would not: the arrays stop there.
    top = min(N, int(max(0.0, np.max(room_all)) // max(1.0, float(np.min(full)))))
    n = np.arange(top + 1, dtype=float)
    # One choice j for all n blocks: n F_j within the last moment and j's own, n L_j within the embedding's.
    most = np.minimum(np.minimum(room_all[:, None], room_base[:, None] - tr[None, :]) / full[None, :],
                      room_embed[:, None] / lean[None, :])  # [C, J]
    single = np.where(n <= np.floor(most)[:, :, None], n * t[None, :, None] + extra_time[:, None, None], INF)
    # Two choices a before b in the canonical order, x of a and y = n - x of b, 1 <= x <= n - 1:
    #   x F_a + y F_b <= min(room_all, room_base - tr_b)   (the last moment: b's)
    #   x F_a + y L_b <= room_base - tr_a                   (a's moment: all of a's activations in)
    #   x L_a + y L_b <= room_embed
    # Each row bounds x from one side; the time is linear in x, so the best x is an end.
    ia, ib = np.triu_indices(J, 1)
    rows = [(full[ia] - full[ib], np.minimum(room_all[:, None], room_base[:, None] - tr[None, ib]), full[ib]),
            (full[ia] - lean[ib], room_base[:, None] - tr[None, ia], lean[ib]),
            (lean[ia] - lean[ib], np.broadcast_to(room_embed[:, None], (C, len(ia))), lean[ib])]
    lo = np.ones((C, len(ia), top + 1))
    hi = np.broadcast_to(n - 1, (C, len(ia), top + 1)).copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        for d, room, w in rows:  # x d <= room - n w
            rhs = room[:, :, None] - n * w[None, :, None]
            d3 = d[None, :, None]
            q = rhs / d3
            hi = np.where(d3 > 0, np.minimum(hi, np.floor(q)), hi)
            lo = np.where(d3 < 0, np.maximum(lo, np.ceil(q)), lo)
            lo = np.where((d3 == 0) & (rhs < 0), INF, lo)
    ok = lo <= hi
    x = np.where(ok, np.where((t[ia] < t[ib])[None, :, None], hi, lo), 0)
    pair = np.where(ok, x * t[ia][None, :, None] + (n - x) * t[ib][None, :, None] + extra_time[:, None, None], INF)
    order_ = np.array(order)
    time_us = np.full((C, J + len(ia), N + 1), INF)
    time_us[:, :, :top + 1] = np.concatenate([single, pair], axis=1)
    count = np.zeros((C, J + len(ia), N + 1), dtype=int)
    count[:, :, :top + 1] = np.concatenate([np.broadcast_to(n, single.shape), x], axis=1)
    return SlotTable(combos=combos, time_us=time_us, first_count=count,
                     first=np.concatenate([order_, order_[ia]]), second=np.concatenate([np.full(J, -1), order_[ib]]))


def slot_curve(p: Problem, g: int, table: SlotTable, tie: tuple | None = None) -> SlotCurve:
    """The least over the mixes and embedding/head choices that subproblem p allows on group g
    (and, for a tied model, whose embedding and head take the split and ZeRO level ``tie``)."""
    key = lambda s: (s.tensor_parallel, s.zero)  # noqa: E731
    combo_ok = np.array([(e < 0 or (p.embed.allows(g, e) and (tie is None or key(p.embed.strategies[e]) == tie)))
                         and (h < 0 or (p.head.allows(g, h) and (tie is None or key(p.head.strategies[h]) == tie)))
                         for e, h in table.combos])
    allowed = np.array([p.block.allows(g, j) for j in range(len(p.block.strategies))] + [True])
    mix_ok = allowed[table.first] & allowed[table.second]  # index -1: the always-true pad
    N = table.time_us.shape[2] - 1
    flat = np.where(combo_ok[:, None, None] & mix_ok[None, :, None], table.time_us, INF).reshape(-1, N + 1)
    best = np.argmin(flat, axis=0)
    cols = np.arange(N + 1)
    time_us = flat[best, cols]
    time_us[0] = INF
    c_of, i_of = np.divmod(best, table.time_us.shape[1])
    combos = np.array(table.combos).reshape(-1, 2)
    return SlotCurve(time_us=time_us, embed=combos[c_of, 0], head=combos[c_of, 1], first=table.first[i_of],
                     second=table.second[i_of], first_count=table.first_count[c_of, i_of, cols])


def _lean_ends(p: Problem, g: int) -> tuple[list[int], list[int]]:
    """The embedding's and the head's choices on group g that no other of the same tensor split
    and ZeRO level class beats or ties on time, ZeRO edge and every memory term (a tied model
    pairs them by split and level, so each class keeps its own)."""
    tie = (lambda s: (s.tensor_parallel, s.zero)) if p.tied else (lambda s: None)  # noqa: E731
    e, h = p.embed, p.head
    embed = {j: (e.time_us[g][j], e.static_bytes[g][j], e.act_bytes[g][j], e.transient_bytes[g][j],
                 e.edge_us[g][j] if e.edge_us else 0) for j in range(len(e.strategies))}
    head = {j: (h.time_us[g][j], h.static_bytes[g][j], h.act_bytes[g][j], h.transient_bytes[g][j],
                h.copy_transient_bytes[g][j] if h.copy_transient_bytes else 0, h.edge_us[g][j] if h.edge_us else 0,
                p.extra_last[g][j] if p.extra_last else 0, p.extra_alone[g][j] if p.extra_alone else 0)
            for j in range(len(h.strategies))}
    return (_pareto(embed, lambda i, j: tie(e.strategies[i]) == tie(e.strategies[j])),
            _pareto(head, lambda i, j: tie(h.strategies[i]) == tie(h.strategies[j])))


def _pareto(vec: dict[int, tuple], comparable=lambda i, j: True) -> list[int]:
    """The keys whose vectors no other comparable one beats or ties everywhere (of ties the first)."""
    return [j for j in vec
            if not any(i != j and comparable(i, j) and all(x <= y for x, y in zip(vec[i], vec[j]))
                       and (vec[i] != vec[j] or i < j) for i in vec)]


def _undominated(p: Problem, g: int, order: list[int]) -> list[int]:
    """The block choices of ``order`` no other beats or ties on time, ZeRO edge and every memory
    term on group g (fewer pairs to try; of ties the first is kept). With the edge among them, a
    subproblem that allows a choice allows the choices that dominate it."""
    b = p.block
    # A block that gives whole hidden states may add an all-gather at a stage's end (``_end_gathers_us``).
    whole = lambda j: int(any(p.gather_us) and gives_whole(b.strategies[j].tensor_parallel,  # noqa: E731
                                                             b.strategies[j].sequence_parallel))
    vec = {j: (b.time_us[g][j], b.static_bytes[g][j], b.act_bytes[g][j], b.transient_bytes[g][j],
               b.edge_us[g][j] if b.edge_us else 0, whole(j)) for j in order}
    return _pareto(vec)


def pipeline_slots(times: np.ndarray, caps: tuple[int, ...], n_blocks: int, depths: list[int],
                   allowed: np.ndarray | None = None) -> tuple[float, dict[int, list[int]]] | None:
    """The least tau at which a pipeline of some allowed depth holds every block, and for each
    depth that does at that tau the group of each slot (slot 0 first). ``times[r, g, place]``
    are the stage curves (place 0: not the first stage, 1: the first). None if nothing holds
    the blocks at any tau. tau is one of the curves' values, found by a 32-way search over them
    (each step one pass of the programme for 32 values at once). ``allowed``: the states of
    stages per group a pipeline may use (``cpsat_fit.price_states``: the cost objective's price
    bound), None for all."""
    K = times.shape[0]
    # [r, g, place, n - 1]: the slowest of 1..n blocks, so the counts within tau are a prefix
    # (a count is taken only if every smaller one is within tau too).
    rising = np.maximum.accumulate(times[..., 1:], axis=-1)
    values = np.unique(rising[np.isfinite(rising)])
    if not values.size:
        return None
    wanted = [d for d in depths if d <= K]

    def most(taus: np.ndarray) -> np.ndarray:  # [tau, r, g, place]: the most blocks within tau
        return (rising[None] <= taus[:, None, None, None, None]).sum(axis=-1)

    def holds(taus: np.ndarray) -> np.ndarray:
        reach = pipeline_reach(most(taus), caps, allowed=allowed)[1]
        return np.any(reach[:, wanted] >= n_blocks, axis=1)

    if not wanted or not holds(values[-1:])[0]:
        return None
    lo, hi = -1, len(values) - 1  # values[lo] fails (lo = -1: below them all), values[hi] holds
    while hi - lo > 1:
        picks = np.unique(np.linspace(lo + 1, hi - 1, min(32, hi - lo - 1)).round().astype(int))
        ok = holds(values[picks])
        if ok.any():
            first = int(np.argmax(ok))
            hi = int(picks[first])
            lo = int(picks[first - 1]) if first else lo
        else:
            lo = int(picks[-1])
    tau = float(values[hi])
    at_tau = most(np.array([tau]))
    states, reach = pipeline_reach(at_tau, caps, keep=True, allowed=allowed)
    placed = {d: _backtrack(states, at_tau[0], d, int(reach[0, d]), caps, allowed)
              for d in wanted if reach[0, d] >= n_blocks}
    return tau, placed


def _backtrack(states: list[np.ndarray], most: np.ndarray, depth: int, total: int, caps: tuple[int, ...],
               allowed: np.ndarray | None = None) -> list[int]:
    """The group of each slot 0..depth-1 of a pipeline that attains ``total`` blocks (its states
    among those ``allowed``)."""
    G = len(caps)
    r = depth - 1
    V = states[r]
    for g in range(G):  # the first stage, at slot depth - 1
        if most[r, g, 1] < 1:
            continue
        for u in zip(*np.nonzero(V >= 0)):
            end = tuple(n + (h == g) for h, n in enumerate(u))
            if u[g] < caps[g] and V[u] + most[r, g, 1] == total and (allowed is None or allowed[end]):
                groups = [g]
                u = list(u)
                for s in range(r - 1, -1, -1):
                    have = states[s + 1][tuple(u)]
                    for h in range(G):
                        if u[h] >= 1 and most[s, h, 0] >= 1:
                            u[h] -= 1
                            if states[s][tuple(u)] >= 0 and states[s][tuple(u)] + most[s, h, 0] == have:
                                groups.append(h)
                                break
                            u[h] += 1
                return groups[::-1]
    raise AssertionError("no placement attains the pipeline's blocks")


def deal_blocks(curves: list[np.ndarray], n_blocks: int, tau: float) -> list[int] | None:
    """Blocks per slot (at least one each) for the least total time with every slot within tau,
    by a min-plus pass over the slots; None if they cannot hold ``n_blocks``."""
    N = n_blocks
    total = np.full(N + 1, INF)
    total[0] = 0.0
    picks = []
    for curve in curves:
        c = np.where(curve <= tau, curve, INF)
        # next total[b] = min over n of total[b - n] + c[n]
        idx = np.arange(N + 1)
        b_minus_n = idx[:, None] - idx[None, :]  # [b, n]
        valid = b_minus_n >= 0
        grid = np.where(valid, total[np.clip(b_minus_n, 0, N)] + c[None, :], INF)
        pick = np.argmin(grid, axis=1)
        total = grid[idx, pick]
        picks.append(pick)
    if not math.isfinite(total[N]):
        return None
    counts, b = [], N
    for pick in reversed(picks):
        counts.append(int(pick[b]))
        b -= counts[-1]
    return counts[::-1]


def shape_plans(p: Problem, tables: dict | None = None) -> list[Layout]:
    """Candidate plans of one shape or ZeRO-edge subproblem: for each pipeline depth that holds
    the blocks at the least tau found, one layout; none when the heuristic finds none.
    ``tables`` holds the slot tables (``slot_table``), shared by a shape's subproblems."""
    G, K = len(p.groups), p.slots
    caps = tuple(min(c, K) for c in p.stages_per_group)
    if math.prod(c + 1 for c in caps) * K > MAX_STATES:
        return []
    tables = {} if tables is None else tables
    for r in range(K):
        for g in range(G):
            for first in (False, True):
                if (r, g, first) not in tables:
                    tables[(r, g, first)] = slot_table(p, r, g, first)
    keys = [None]
    if p.tied:  # the embedding and head share a weight: the same split and ZeRO level
        key = lambda s: (s.tensor_parallel, s.zero)  # noqa: E731
        keys = sorted({key(s) for s in p.embed.strategies} & {key(s) for s in p.head.strategies})
    out = []
    for tie in keys:
        curves = [[[slot_curve(p, g, tables[(r, g, first)], tie) for first in (False, True)] for g in range(G)]
                  for r in range(K)]
        out += _plans_for(p, curves, caps)
    return out


def _plans_for(p: Problem, curves: list, caps: tuple[int, ...]) -> list[Layout]:
    K, G = p.slots, len(p.groups)
    # Each side of a stage boundary at its dearest partner: the stage time holds wherever its neighbours sit.
    send = [max(p.p2p_us[g]) for g in range(G)]
    receive = [max(row[g] for row in p.p2p_us) for g in range(G)]
    times = np.empty((K, G, 2, p.n_blocks + 1))
    for r in range(K):
        for g in range(G):
            for place in (0, 1):
                boundary = (send[g] if r > 0 else 0) + (receive[g] if place == 0 and r + 1 < K else 0)
                gathers = _end_gathers_us(p, g, curves[r][g][place], receives=place == 0, sends=r > 0)
                times[r, g, place] = curves[r][g][place].time_us + boundary + gathers
    times[K - 1, :, 0] = INF  # the deepest slot can only be the first stage
    depths = sorted(set(p.pipeline) if p.pipeline else range(1, K + 1))
    found = pipeline_slots(times, caps, p.n_blocks, depths, price_states(p, caps, K))
    if found is None:
        return []
    tau, placed = found
    out = []
    for depth, groups in sorted(placed.items()):
        places = [1 if r == depth - 1 else 0 for r in range(depth)]
        counts = deal_blocks([times[r, g, place] for r, (g, place) in enumerate(zip(groups, places))], p.n_blocks, tau)
        if counts is None:
            continue
        if p.price_cap is not None and sum(p.stage_price[g] for g in groups) > p.price_cap:
            continue
        out.append(_layout(p, [(g, curves[r][g][place], n)
                               for r, (g, place, n) in enumerate(zip(groups, places, counts))]))
    return out


def _end_gathers_us(p: Problem, g: int, curve: SlotCurve, *, receives: bool, sends: bool) -> np.ndarray | int:
    """[n]: the all-gathers a stage's end blocks run at split boundaries (``costs.stage.boundary_gathers``),
    for the mix the curve takes at each n: its first choice starts the stage (its second when it
    has none of the first), its second ends it (its first when it has none of the second)."""
    if not p.gather_us or not p.gather_us[g]:
        return 0
    whole = np.array([gives_whole(s.tensor_parallel, s.sequence_parallel) for s in p.block.strategies] + [False])
    n = np.arange(len(curve.time_us))
    first = np.where(curve.first_count > 0, curve.first, curve.second)  # index -1: the pad
    last = np.where((curve.second >= 0) & (curve.first_count < n), curve.second, curve.first)
    return p.gather_us[g] * (receives * whole[first].astype(int) + sends * whole[last].astype(int))


def _layout(p: Problem, slots: list[tuple[int, SlotCurve, int]]) -> Layout:
    """The layout of slots (group, curve, blocks), slot 0 the last stage: each stage's layers
    in the canonical order, as ``PlanModel.read_layout`` writes them."""
    pp = len(slots)
    stage_layers = []
    next_block = 0
    for s in range(pp):
        r = pp - 1 - s
        g, curve, n = slots[r]
        layers: list[LayerStrategy] = []
        if s == 0:
            layers.append(dataclasses.replace(p.embed.strategies[int(curve.embed[n])], name="embed"))
        counts = {int(curve.first[n]): int(curve.first_count[n])}
        if curve.second[n] >= 0:
            counts[int(curve.second[n])] = n - int(curve.first_count[n])
        for j in (p.block.order[g] if p.block.order else range(len(p.block.strategies))):
            for _ in range(counts.get(j, 0)):
                layers.append(dataclasses.replace(p.block.strategies[j], name=f"layers.{next_block}"))
                next_block += 1
        if r == 0:
            layers.append(dataclasses.replace(p.head.strategies[int(curve.head[n])], name="head"))
        stage_layers.append(tuple(layers))
    sh = p.shape
    return Layout(stage_groups=tuple(p.groups[g] for g, _, _ in slots[::-1]), stage_layers=tuple(stage_layers),
                  dp=sh.dp, tp=sh.tp, micro_batch=sh.micro_batch, num_micro_batches=sh.num_micro_batches)
