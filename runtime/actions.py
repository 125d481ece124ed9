"""Each rank's pipeline actions, in order, as torch's schedule classes emit them.

The search prices schedules by closed forms (``partita.search.schedules``) that the tests hold
against these lists, played by ``schedules.simulate``; the pictures of a plan
(``partita show --timeline``) play them too. They come from torch's schedule visualiser, so they
are what the runtime's schedule (``runtime/schedule.py``) executes.
"""

from __future__ import annotations

from functools import lru_cache

from partita.errors import PartitaError
from partita.parallel import Action, schedule_rule

# Torch's classes for the plan's schedules (``partita.parallel.SCHEDULES``).
TORCH_CLASSES = {
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


@lru_cache(maxsize=256)
def torch_actions(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions, in order, as torch's schedule class emits them."""
    if schedule == "1f1b" and v == 1:
        return tuple(_one_f_one_b(r, pp, m) for r in range(pp))  # written out: any m
    why = schedule_rule(schedule, pp, v, m)
    if why:
        raise PartitaError(why)
    from torch.distributed.pipelining import _schedule_visualizer as visualizer
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_CLASSES[schedule])
    ops = visualizer.get_schedule_ops(cls, pp, m, num_stages_per_rank=v if v > 1 else None)
    out = []
    for row in ops:
        acts = []
        for a in row:
            if a is None:
                continue
            kind = str(getattr(a.computation_type, "value", a.computation_type))
            if kind in ("F", "B", "I", "W"):
                acts.append(Action(a.stage_index, kind, a.microbatch_index))
        out.append(tuple(acts))
    return tuple(out)


def _one_f_one_b(rank: int, pp: int, m: int) -> tuple[Action, ...]:
    """Torch's ``Schedule1F1B`` order on one rank: pp - rank forwards, then backward and forward
    in turn, then the remaining backwards. (Its visualiser misnumbers the micro-batches of
    single-stage schedules, so this one order is written out.)"""
    warm = min(pp - rank, m)
    acts = [Action(rank, "F", i) for i in range(warm)]
    for i in range(m - warm):
        acts += [Action(rank, "B", i), Action(rank, "F", warm + i)]
    acts += [Action(rank, "B", i) for i in range(m - warm, m)]
    return tuple(acts)
