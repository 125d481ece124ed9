"""Collectives on 2 and 4 gloo ranks, and the latency + bandwidth fit.

One run spawns 4 CPU ranks and measures all-reduce, all-gather, reduce-scatter and all-to-all on
groups of 2 and 4 and p2p between 2, at 4 KiB .. 4 MiB (every 4x): the live test checks what is
measured, never how fast (times on a shared 2-core machine are not a test's to judge). The fit's
accuracy is checked on a recorded run of the same measurement (``tests/data/comm``): for every
(op, group) the fit is made without the 256 KiB point and must predict it, the median relative
error over the nine fits within 50 % and each within 150 % (the recording: median 17 %, worst
38 %; live runs here gave medians of 15-35 %, and single fits up to 177 % under load, which is
why the live run is not held to it).
"""

import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest

pytest.importorskip("torch")

from partita.profile import COMM_OPS  # noqa: E402
from partita.profiler.comm import CommOptions, CommSample, fit_comm, plan_groups, spawn_and_measure  # noqa: E402
from partita.profiler.fit import fit_latency_bandwidth, relative_errors  # noqa: E402
from partita.units import KiB, MiB  # noqa: E402

HELD_BACK = 256 * KiB
RECORDED = Path(__file__).parent / "data" / "comm" / "gloo_4_ranks.json"


def recorded() -> list[CommSample]:
    return [CommSample(**s) for s in json.loads(RECORDED.read_text())["samples"]]


@pytest.fixture(scope="module")
def samples():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # repeats=9: the median of more runs steadies the times on shared cores (the bounds stay)
    opts = CommOptions(min_bytes=4 * KiB, max_bytes=4 * MiB, warmup=1, repeats=9, iters=2)
    return spawn_and_measure(opts, 4)


def test_groups_of_2_and_4_are_measured(samples):
    keys = {(s.op, s.link, s.ranks) for s in samples}
    expected = {(op, "loopback", n) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
                for n in (2, 4)}
    assert keys == expected | {("p2p", "loopback", 2)}
    assert all(s.seconds > 0 for s in samples)
    assert {s.message_bytes for s in samples} == {4 * KiB * 4**i for i in range(6)}


def test_fit_predicts_a_held_back_size():
    samples = recorded()
    errors = {}
    for key in sorted({(s.op, s.ranks) for s in samples}):
        points = [s for s in samples if (s.op, s.ranks) == key]
        train = [s for s in points if s.message_bytes != HELD_BACK]
        (held,) = [s for s in points if s.message_bytes == HELD_BACK]
        fit = fit_latency_bandwidth([s.bus_bytes for s in train], [s.seconds for s in train])
        assert fit is not None, f"{key}: times do not grow with size: {[(s.message_bytes, s.seconds) for s in train]}"
        errors[key] = relative_errors(fit, [held.bus_bytes], [held.seconds])[0]
    assert statistics.median(errors.values()) <= 0.5, errors
    assert max(errors.values()) <= 1.5, errors


def test_fits_go_into_profile_comm_entries():
    costs = fit_comm(recorded())
    assert [c.op for c in costs] == sorted((c.op for c in costs), key=COMM_OPS.index)
    assert len(costs) == 9
    for c in costs:
        assert c.latency_s >= 0 and c.bandwidth_gbps > 0


def test_an_op_whose_times_are_flat_is_left_out_with_a_warning(caplog):
    # What test_profiler's live 2-rank profile may meet on a loaded machine, made certain: the
    # recorded p2p times flattened over the sizes. That fit is dropped, named in a warning, and
    # the other eight are written as before, in the ops' order.
    samples = [dataclasses.replace(s, seconds=1e-3) if s.op == "p2p" else s for s in recorded()]
    with caplog.at_level("WARNING", logger="partita.profiler.comm"):
        costs = fit_comm(samples)
    assert [(c.op, c.ranks) for c in costs] == [(c.op, c.ranks) for c in fit_comm(recorded()) if c.op != "p2p"]
    assert len(costs) == 8
    assert any("p2p on 2 loopback ranks" in r.getMessage() and "widen --comm-sizes" in r.getMessage()
               for r in caplog.records)


def test_group_plan_spans_nodes_when_there_are_several():
    groups = plan_groups(world=16, local_world=8, intra_link="nvlink")
    assert groups == [("nvlink", [0, 1]), ("nvlink", [0, 1, 2, 3]), ("nvlink", list(range(8))), ("network", [0, 8])]
    assert plan_groups(world=6, local_world=6, intra_link="pcie")[-1] == ("pcie", list(range(6)))
