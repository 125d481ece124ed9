"""Pipeline schedules: what a step costs under each, from the schedule's own action lists.

A schedule is an order of actions per rank: F (forward of one micro-batch through one stage),
B (its whole backward), or, for zero-bubble schedules, I (the backward to the input) and W (to
the weights; it can wait, and fills the pipeline's bubble). ``simulate`` plays such lists with
a duration per stage and action kind, each action waiting for the rank's previous one and for
its data (a forward for the previous stage's forward of that micro-batch, a backward for the
next stage's backward, plus a send), and returns the step's makespan, each rank's busy time and
the most micro-batches whose activations each rank holds at once. The action lists are torch's own
(``partita.runtime.actions.torch_actions``: its schedule classes, through its schedule
visualiser), so the simulation is of what the runtime executes; ``closed_form_s`` gives the
formulas the search uses, and the tests compare the two.

Stages are numbered as torch numbers them: with v stages per rank ("virtual stages", the
interleaved schedules), rank r holds stages r, r + pp, ..., r + (v - 1) pp; the ZB-V schedule
holds r and 2 pp - 1 - r (a V). This module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from partita.errors import PartitaError
from partita.parallel import Action, rounds

# The split the closed forms assume for one micro-batch through one stage: forward F, input
# gradient I and weight gradient W a third of it each. A matrix product's backward is two
# products of its size (one for the input gradient, one for the weight's), so backward = 2 x
# forward and I = W = backward / 2 for layers whose time is their matrix products (Qi et al.,
# "Zero Bubble Pipeline Parallelism", ICLR 2024, §2: T_F ~ T_B ~ T_W, B the input gradient).
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class Simulation:
    makespan_s: float
    busy_s: tuple[float, ...]  # per rank: the time its actions take
    in_flight: tuple[int, ...]  # per rank: most (stage, micro-batch) pairs holding activations at once

    @property
    def bubble_s(self) -> float:
        """The idle time of the busiest rank."""
        return self.makespan_s - max(self.busy_s)


@dataclass(frozen=True)
class Event:
    """One action played on one rank, in seconds from the step's start."""

    rank: int
    stage: int
    kind: str  # "F", "B", "I", "W", or "send" (a blocking send, on the sending rank)
    micro_batch: int
    start_s: float
    end_s: float


def play(actions: Sequence[Sequence[Action]], forward_s: Sequence[float], backward_s: Sequence[float], *,
         weight_share: float = 0.5, send_s: float | Callable[[int, int], float] = 0.0,
         blocking_sends: bool = False) -> list[Event]:
    """Play the ranks' action lists: ``forward_s[s]``/``backward_s[s]`` per micro-batch of stage
    s; a split backward spends ``weight_share`` of it in W and the rest in I. A forward waits
    for the previous stage's forward of its micro-batch, a backward (or I) for the next stage's,
    each plus the send between the two stages when they sit on different ranks (``send_s``, a
    time or a function of the two stages). With ``blocking_sends`` a send also holds its sender
    (both sides of a blocking send wait), and comes back as an event of kind "send"."""
    rank_of = {a.stage: r for r, row in enumerate(actions) for a in row}
    last = max(rank_of)
    send = send_s if callable(send_s) else (lambda a, b: send_s)

    def hop(a: int, b: int) -> float:
        return send(a, b) if rank_of[a] != rank_of[b] else 0.0

    def ready(a: Action) -> float | None:
        if a.kind == "F":
            if a.stage == 0:
                return 0.0
            t = done.get(("F", a.stage - 1, a.micro_batch))
            return None if t is None else t + hop(a.stage - 1, a.stage)
        if a.kind == "W":
            return done.get(("I", a.stage, a.micro_batch))
        own = done.get(("F", a.stage, a.micro_batch))
        if own is None or a.stage == last:
            return own
        t = done.get(("B", a.stage + 1, a.micro_batch), done.get(("I", a.stage + 1, a.micro_batch)))
        return None if t is None else max(own, t + hop(a.stage, a.stage + 1))

    share = {"F": None, "B": 1.0, "I": 1 - weight_share, "W": weight_share}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(actions)
    pos = [0] * len(actions)
    events: list[Event] = []
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for r, row in enumerate(actions):
            while pos[r] < len(row):
                a = row[pos[r]]
                at = ready(a)
                if at is None:
                    break
                dur = forward_s[a.stage] if share[a.kind] is None else backward_s[a.stage] * share[a.kind]
                start = max(clock[r], at)
                clock[r] = start + dur
                done[(a.kind, a.stage, a.micro_batch)] = clock[r]
                events.append(Event(r, a.stage, a.kind, a.micro_batch, start, clock[r]))
                to = a.stage + 1 if a.kind == "F" else a.stage - 1
                if blocking_sends and a.kind in ("F", "B", "I") and 0 <= to <= last and rank_of[to] != r:
                    events.append(Event(r, a.stage, "send", a.micro_batch, clock[r], clock[r] + hop(a.stage, to)))
                    clock[r] += hop(a.stage, to)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PartitaError("the pipeline schedule's actions wait on each other (deadlock)")
    return events


def simulate(actions: Sequence[Sequence[Action]], forward_s: Sequence[float], backward_s: Sequence[float], *,
             weight_share: float = 0.5, send_s: float = 0.0) -> Simulation:
    """``play`` the ranks' action lists (sends not blocking): the makespan, each rank's busy
    time and the most (stage, micro-batch) pairs whose activations it holds at once (a forward
    adds one, a whole backward or a weight-gradient pass frees it)."""
    busy = [0.0] * len(actions)
    holding = [0] * len(actions)
    most = [0] * len(actions)
    end = 0.0
    for e in play(actions, forward_s, backward_s, weight_share=weight_share, send_s=send_s):
        busy[e.rank] += e.end_s - e.start_s
        end = max(end, e.end_s)
        if e.kind == "F":
            holding[e.rank] += 1
            most[e.rank] = max(most[e.rank], holding[e.rank])
        elif e.kind in ("B", "W"):
            holding[e.rank] -= 1
    return Simulation(makespan_s=end, busy_s=tuple(busy), in_flight=tuple(most))


def closed_form_s(schedule: str, rank_times: Sequence[float], m: int, v: int) -> float:
    """The step the search prices, from each rank's time T_r for one micro-batch through all
    its stages (forward + backward, sends included), M = max T:

    * 1F1B: (m - 1) M + sum T;
    * interleaved 1F1B: (m - 1) M + sum T / v + (1 - 1/v) M: the warm-up and the drain
      pass a micro-batch through one virtual stage (T_r / v) per rank instead of a whole rank
      (the bubble shrinks v-fold, Narayanan et al., SC'21, section 2.2.2), and one whole
      micro-batch still crosses the slowest rank;
    * interleaved zero-bubble: (m - 1) M + sum T / 3v + (1 - 1/3v) M: the same with the
      fill and drain a third as long, one F (or I) of a virtual stage per rank, F = I = W =
      T / 3v (``FORWARD_SHARE``): the weight gradients fill the rest (torch's ZB1P; on equal
      ranks its bubble is (pp - 1) max(F, I, F + I - W) whatever m);
    * ZB-V (two stages per rank, in a V; F = I = W = T / 6): with m >= 2 pp - 1 micro-batches
      (m - 1) M + sum T / 6 + (5/6) M; with fewer, torch's schedule leaves
      max(pp - 1, 2 (2 pp - 1 - m)) idle F-slots per rank: m M + that x M / 6.

    Each equals ``simulate`` on torch's action lists when the ranks are equal, and is never
    below it otherwise (tests/test_schedules.py; the short ZB-V form prices every rank at the
    slowest one's time, and a schedule's makespan only grows with its actions' durations)."""
    slowest, total = max(rank_times), sum(rank_times)
    if schedule == "1f1b":
        return (m - 1) * slowest + total
    if schedule == "interleaved-1f1b":
        return (m - 1) * slowest + total / v + (1 - 1 / v) * slowest
    if schedule == "interleaved-zb":
        part = FORWARD_SHARE / v
        return (m - 1) * slowest + total * part + (1 - part) * slowest
    if schedule == "zbv":
        pp, part = len(rank_times), FORWARD_SHARE / 2
        if m >= 2 * pp - 1:
            return (m - 1) * slowest + total * part + (1 - part) * slowest
        return m * slowest + max(pp - 1, 2 * (2 * pp - 1 - m)) * part * slowest
    raise PartitaError(f"no closed form for {schedule!r}")


def in_flight_chunks(schedule: str, rank: int, pp: int, v: int, m: int) -> int:
    """The most (stage, micro-batch) pairs whose activations rank ``rank`` holds at once,
    from a forward until its backward (zero-bubble: until its weight gradient W, which needs
    them), with k = m // max(1, m // pp) micro-batches per round:

    * 1F1B: min(pp - rank, m) (whole stages);
    * interleaved 1F1B: min((v - 1) k + 2 (pp - rank - 1) + 1, m v), in virtual stages of
      about 1/v of the rank's layers each (torch's warm-up, then one more forward);
    * interleaved zero-bubble: min((v - 1) k + pp, m v): the warm-up is (v - 1) k + pp - 1 -
      rank forwards, and each W comes ``rank`` backwards after its I (``pending_weight_grads``);
    * ZB-V: min(m + rank + 1, 2 min(m, pp)): with enough micro-batches 2 pp on every rank."""
    _, per_round = rounds(pp, m)
    if schedule == "1f1b":
        return min(pp - rank, m)
    if schedule == "interleaved-1f1b":
        return min((v - 1) * per_round + 2 * (pp - rank - 1) + 1, m * v)
    if schedule == "interleaved-zb":
        return min((v - 1) * per_round + pp, m * v)
    if schedule == "zbv":
        return min(m + rank + 1, 2 * min(m, pp))
    raise PartitaError(f"no in-flight count for {schedule!r}")


def pending_weight_grads(schedule: str, rank: int, pp: int, m: int) -> int:
    """The most (stage, micro-batch) pairs whose input gradient I has run and weight gradient W
    not yet, on rank ``rank``: each keeps the gradients at the outputs of its stage's weight
    products for W (torch's ``stage_backward_input`` saves them; its activations are counted
    in flight). Interleaved zero-bubble: rank + 1 (its W lags its I by ``rank`` backwards);
    ZB-V: 2 rank + 1 with m >= 2 pp - 1 micro-batches (its drain runs the I of both stages
    first), and at most that with fewer (torch drops the missing micro-batches' actions from
    the same order). Schedules without a split backward keep none."""
    if schedule == "interleaved-zb":
        return rank + 1
    if schedule == "zbv":
        return 2 * rank + 1
    return 0


def chunk_in_flight(schedule: str, rank: int, pp: int, v: int, m: int) -> tuple[int, ...]:
    """The most (stage, micro-batch) pairs of each of rank ``rank``'s virtual stages (its
    chunk c = torch's stage r + c pp, under ZB-V c = 0, 1 for r and 2 pp - 1 - r) that it holds
    at once; together never more than ``in_flight_chunks``, each at most m. The memory model
    charges the head's logits for the pairs of the chunk that holds it (the activations:
    interleaved 1F1B's moment by moment, ``held_moments``; the zero-bubble schedules' every pair
    at the largest virtual stage's).

    * interleaved 1F1B: counted on torch's order (``interleaved_1f1b_order``): (v - 1) k + 2
      (pp - rank - 1) warm-up forwards, chunk (f // k) mod v for forward f, then a forward and a
      backward in turn, the backwards from chunk v - 1 down, k at a time. The last rank's last
      chunk (the head's) holds one: each of its forwards is followed by that backward;
    * interleaved zero-bubble: the last chunk min(k, pp), the others m;
    * ZB-V: chunk 0 min(m, 2 pp - rank), chunk 1 (the V's way back; rank 0's holds the head)
      rank + 1.

    tests/test_schedules.py holds these against torch's own action lists."""
    _, k = rounds(pp, m)
    if schedule == "interleaved-1f1b":
        return _count_chunks(interleaved_1f1b_order(rank, pp, v, m), v)
    if schedule == "interleaved-zb":
        return tuple(min(k, pp) if c == v - 1 else m for c in range(v))
    if schedule == "zbv":
        return min(m, 2 * pp - rank), min(m, rank + 1)
    if schedule == "1f1b":
        return (min(pp - rank, m),)
    raise PartitaError(f"no in-flight count for {schedule!r}")


def interleaved_1f1b_order(rank: int, pp: int, v: int, m: int) -> tuple[tuple[str, int], ...]:
    """Rank ``rank``'s (kind, chunk) actions under torch's ``ScheduleInterleaved1F1B``, in
    order: its warm-up forwards, then forward and backward in turn, then the cool-down
    backwards (``in_flight_chunks``' count: the warm-up and one more forward)."""
    _, k = rounds(pp, m)
    total = m * v
    warm = min((v - 1) * k + 2 * (pp - rank - 1), total)
    out: list[tuple[str, int]] = []
    f = b = 0
    while f < warm:
        out.append(("F", (f // k) % v))
        f += 1
    while f < total or b < total:
        if f < total:
            out.append(("F", (f // k) % v))
            f += 1
        out.append(("B", v - 1 - (b // k) % v))
        b += 1
    return tuple(out)


@lru_cache(maxsize=4096)
def held_moments(rank: int, pp: int, v: int, m: int) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """The moments of rank ``rank`` under interleaved 1F1B, on torch's order
    (``interleaved_1f1b_order``): at each of its actions, (the virtual stage that runs, the
    (stage, micro-batch) pairs of each virtual stage the rank holds, the tensors it has sent
    that only their sends still hold). A forward's pair is counted from its start, a backward's
    until its end. Torch's runtime for several stages a rank waits for its sends at the step's
    end (``_PipelineScheduleRuntime``), so every tensor sent stays until then: a gradient sent
    back from the moment its backward ends, an output sent on from the moment its pair's
    backward ends (until then the pair keeps it). Of the moments of one running virtual stage,
    those no other holds at least as much of; most first. The memory model charges the largest
    (``costs.stage.interleaved_stage_cost``): the exact most a rank holds; each one is a lower
    bound on it (``interleaved_bound``)."""
    held, dead = [0] * v, 0
    most_dead: dict[tuple[int, tuple[int, ...]], int] = {}  # the sent tensors only grow: the last of each
    sends_on = [c * pp + rank < pp * v - 1 for c in range(v)]  # its output goes to another stage
    sends_back = [c * pp + rank > 0 for c in range(v)]  # its input gradient goes back
    for kind, c in interleaved_1f1b_order(rank, pp, v, m):
        if kind == "F":
            held[c] += 1
            most_dead[(c, tuple(held))] = dead
        else:
            most_dead[(c, tuple(held))] = dead
            held[c] -= 1
            dead += sends_back[c] + sends_on[c]
    frontier: list[tuple[int, tuple[int, ...], int]] = []
    # a moment that holds at least as much of everything sorts first
    for (c, x), d in sorted(most_dead.items(), key=lambda kv: (-sum(kv[0][1]) - kv[1], kv)):
        if not any(e == c and f >= d and all(a >= b for a, b in zip(y, x)) for e, y, f in frontier):
            frontier.append((c, x, d))
    return tuple(frontier)


def _count_chunks(order: Sequence[tuple[str, int]], v: int) -> tuple[int, ...]:
    held, most = [0] * v, [0] * v
    for kind, c in order:
        held[c] += 1 if kind == "F" else -1
        most[c] = max(most[c], held[c])
    return tuple(most)
