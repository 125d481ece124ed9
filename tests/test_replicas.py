"""Replicas on different device types (``Stage.replica_groups``, ``search/replicas.py``): the
plan format and validator, the cost model's pricing of each kind of replica, the search on a
mixed H100/V100 cluster, and a gloo run against one process on the whole batch."""

import dataclasses
import re

import pytest

from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.model_io import load_model
from partita.plan import Plan
from partita.search.costs.model import CostModel
from partita.search.evaluate import evaluate_layout, evaluate_plan
from partita.search.planner import PlanRequest, make_plan
from partita.search.plans import attach_prediction
from partita.search.replicas import (ReplicaCandidate, _shapes, replica_plan, replica_search, replicas_on,
                                     throughput_bound_s)
from partita.search.uniform import MAX_MICRO_BATCH, SearchSpace
from partita.validate import validate_plan

MIXED = "2x8xH100+6x8xV100-32GB"


@pytest.fixture(scope="module")
def gpt2_mixed():
    model, cluster = load_model("gpt2-medium"), parse_short(MIXED)
    plan, _ = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=512))
    return model, cluster, plan


def test_fast_replicas_take_larger_shares_and_use_every_gpu(gpt2_mixed):
    model, cluster, plan = gpt2_mixed
    assert plan.mixed_replicas and plan.world_size == cluster.world_size
    sizes = plan.replica_micro_batch_sizes()
    on = {g: [sizes[d] for d in range(plan.dp) if plan.replica_path(d)[0] == g] for g in ("h100", "v100-32gb")}
    assert min(on["h100"]) > max(on["v100-32gb"])  # the H100s take more rows
    assert sum(plan.replica_batch_rows()) == 512
    # The H100s alone (the best plan on part of the cluster) are slower.
    alone, _ = make_plan(PlanRequest(model=model, cluster=parse_short("2x8xH100"), seq_len=model.seq_len,
                                     global_batch=512))
    assert plan.prediction.step_time_s < 0.9 * alone.prediction.step_time_s
    # The replica search covers its space (every shape water-filled or ruled out), so the bound is
    # the lower of CP-SAT's over its space and the replica space's optimum: here the plan itself.
    assert plan.solver.bound_us <= plan.solver.objective_us
    assert plan.solver.gap <= 0.01
    validate_plan(plan, model, cluster)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_the_step_is_the_slowest_kind_of_replica(gpt2_mixed):
    model, cluster, plan = gpt2_mixed
    cm = CostModel(model, cluster, seq_len=plan.seq_len, dtype=plan.dtype)
    ev = evaluate_plan(plan, cm)
    kinds = plan.replica_kinds()
    assert len(ev.replicas) == len(kinds) >= 2
    span = cm.spanning(["h100", "v100-32gb"])
    for (path, size, count), _ in kinds.items():
        alone = evaluate_layout(span, [(cluster.group(g), s.layers) for g, s in zip(path, plan.stages)], dp=plan.dp,
                                tp=plan.tp, micro_batch=size, num_micro_batches=count)
        assert alone.step_time_s <= ev.step_time_s + 1e-12
    assert ev.step_time_s == max(k.step_time_s for _, k in ev.replicas)
    # Rows moved from the H100s to the V100s make the V100 replicas the slow ones, and slower.
    sizes = list(plan.replica_micro_batch_sizes())
    v100 = [d for d in range(plan.dp) if plan.replica_path(d)[0] == "v100-32gb"]
    h100 = [d for d in range(plan.dp) if plan.replica_path(d)[0] == "h100"]
    for d, e in zip(h100, v100):
        sizes[d] -= 2
        sizes[e] += 2
    moved = dataclasses.replace(plan, micro_batch_sizes=tuple(sizes), micro_batch=max(sizes), prediction=None)
    assert evaluate_plan(moved, cm).step_time_s > ev.step_time_s


def test_collectives_across_groups_run_at_the_slowest_link():
    cluster = parse_short(MIXED)
    cm = CostModel(load_model("gpt2-medium"), cluster, seq_len=1024)
    h100, v100 = cluster.groups
    span = cm.spanning([h100.name, v100.name])
    assert span.dp_link(h100, 64, 1).gbps == span.dp_link(v100, 64, 1).gbps
    assert span.dp_link(h100, 64, 1).gbps <= min(cm.dp_link(h100, 16, 1).gbps, cm.dp_link(v100, 48, 1).gbps)
    assert cm.spanning([h100.name]) is cm and cm.spanning([v100.name, h100.name]) is span


def test_the_throughput_bound_holds_for_plans_on_the_cluster(gpt2_mixed):
    model, cluster, plan = gpt2_mixed
    cm = CostModel(model, cluster, seq_len=plan.seq_len, dtype=plan.dtype)
    bound = throughput_bound_s(cm, 512)
    assert 0 < bound <= plan.prediction.step_time_s
    for sub in ("2x8xH100", "6x8xV100-32GB"):
        p, _ = make_plan(PlanRequest(model=model, cluster=parse_short(sub), seq_len=model.seq_len, global_batch=512))
        assert bound <= p.prediction.step_time_s


def test_replicas_align_with_nodes():
    cluster = parse_short("2x8xH100+6x8xV100-32GB")
    assert replicas_on(cluster.groups[0], 1, 1) == 16
    assert replicas_on(cluster.groups[1], 2, 4) == 4  # 6 would put a stage's part across 1.5 nodes
    assert replicas_on(cluster.groups[1], 8, 8) == 0


@pytest.mark.parametrize("change, message", [
    (lambda s: dataclasses.replace(s, replica_groups=s.replica_groups[:-1]), "one node group per"),
    (lambda s: dataclasses.replace(s, replica_groups=tuple(reversed(s.replica_groups))), "first replica's group"),
    (lambda s: dataclasses.replace(s, replica_groups=(s.replica_groups[0],) * len(s.replica_groups)), "not in group"),
])
def test_the_validator_names_a_bad_replica_group(gpt2_mixed, change, message):
    model, cluster, plan = gpt2_mixed
    bad = dataclasses.replace(plan, stages=(change(plan.stages[0]),) + plan.stages[1:])
    with pytest.raises(PartitaError, match=message):
        validate_plan(bad, model, cluster)


def test_the_summary_shows_each_kind_of_replica(gpt2_mixed, tmp_path, capsys):
    from partita.cli import main

    *_, plan = gpt2_mixed
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    # One entry per kind (device type and rows), with its count: 16 H100 replicas, the 48 V100s
    # in one or more kinds of their own.
    assert "replicas: 16 on h100 (H100)" in out
    v100 = re.findall(r"(\d+) on v100-32gb", " ".join(out.split()))
    assert sum(map(int, v100)) == 48 and len(v100) == len(plan.replica_kinds()) - 1
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(tmp_path / "x.toml")]) == 2
    assert "different device types" in capsys.readouterr().err


# ---- the runtime --------------------------------------------------------------------------


def test_replicas_on_two_groups_train_like_one_process(tmp_path):
    """dp 2 x pp 2 on two CPU groups: replica 0 on the first group's two ranks, replica 1 on
    the second's, with micro-batch sizes 3 and 1 (ranks 0, 2 form stage 0; 1, 3 stage 1)."""
    pytest.importorskip("torch")
    from partita.plan import Stage
    from partita.runtime.train import TrainConfig
    from runtime_helpers import assert_trains_like_one_process
    from runtime_helpers import make_plan as runtime_plan

    model = dataclasses.replace(BUILTIN["tiny-llama"], name="tiny-llama-4", n_layers=4)
    cluster = parse_short("1x2xcpu+1x2xcpu")
    base = runtime_plan(model, dp=2, pp=2, boundaries=[2], num_micro_batches=2, cluster="1x2xcpu+1x2xcpu",
                        layer=dict(zero=1), per_layer={"head": dict(zero=3), "layers.0": dict(zero=0)})
    a, b = (g.name for g in cluster.groups)
    stages = tuple(Stage(index=s.index, group=a, device="cpu", ranks=(s.index, 2 + s.index), layers=s.layers,
                         replica_groups=(a, b)) for s in base.stages)
    plan = dataclasses.replace(base, stages=stages, micro_batch_sizes=(3, 1), micro_batch=3, global_batch=8)
    validate_plan(plan, model, cluster)
    cm = CostModel(model, cluster, seq_len=plan.seq_len)
    assert attach_prediction(plan, cm).prediction.step_time_s > 0
    assert_trains_like_one_process(plan, TrainConfig(steps=2, warmup_steps=1, lr=1e-3), tmp_path)


def test_a_mixed_replica_plan_prints_schema_valid_json(gpt2_mixed, tmp_path, capsys):
    import json
    from pathlib import Path

    from partita.cli import main

    jsonschema = pytest.importorskip("jsonschema")
    *_, plan = gpt2_mixed
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert main(["show", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(out, json.loads((Path(__file__).parent.parent / "docs" / "json-schema.json").read_text()))
    assert out["plan"]["stages"][0]["replica_groups"][:1] == ["h100"]


def test_mixtures_of_experts_keep_one_device_type_per_stage():
    """The replica search is dense models' only (experts assume one device type per replica
    group): a mixture-of-experts plan on a mixed cluster stays a valid CP-SAT plan."""
    model, cluster = load_model("mixtral-8x7b"), parse_short("2x8xH100+2x8xA100-80GB")
    plan, _ = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=1024))
    assert not plan.mixed_replicas and plan.ep > 1
    validate_plan(plan, model, cluster)


def test_the_replica_search_finds_the_optimum_of_its_space_by_brute_force():
    """Every replica plan of a small mixed cluster enumerated (every shape, every micro-batch size
    of every group, the last group's replicas one row less as the plan format allows), each priced
    as a whole plan: the search's best is the least of them, and it says its search was complete."""
    import itertools

    model = BUILTIN["tiny-llama"]
    cluster = parse_short("2xA100-80GB+2xV100-32GB")
    cm = CostModel(model, cluster, seq_len=model.seq_len, dtype="fp16")
    base, _ = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=8, dtype="fp16"))
    found = replica_search(cm, global_batch=8, space=SearchSpace(), incumbent_s=float("inf"))
    assert found.complete and found.best is not None
    span = cm.spanning(g.name for g in cluster.groups)
    best, priced = float("inf"), 0
    for used, tp, pp, m, sp, zero, recompute in _shapes(cm, span, tuple(cluster.groups), 8, SearchSpace()):
        rows = 8 // m
        counts = [n for _, n in used]
        for sizes in itertools.product(range(1, min(rows, MAX_MICRO_BATCH) + 1), repeat=len(used)):
            for smaller in itertools.product(*[range(0, n) for n in counts]):
                if sum(n * b - k for n, b, k in zip(counts, sizes, smaller)) != rows:
                    continue
                if any(k and b == 1 for b, k in zip(sizes, smaller)):
                    continue
                cand = ReplicaCandidate(groups=tuple(g for g, _ in used), replicas=tuple(counts), tp=tp, pp=pp,
                                        num_micro_batches=m, sizes=sizes, smaller=smaller, sp=sp, zero=zero,
                                        recompute=recompute, step_time_s=0.0)
                ev = evaluate_plan(replica_plan(cm, cand, base), cm)
                priced += 1
                if ev.fits:
                    best = min(best, ev.step_time_s)
    assert priced > 300  # shapes x sizes: the space is not trivial (384 plans)
    assert found.best.step_time_s == pytest.approx(best, rel=1e-9)
