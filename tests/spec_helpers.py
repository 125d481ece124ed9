"""Hand-built valid specs the spec and parser tests start from: a measured-looking profile and a
two-stage plan on 4xcpu (tests/test_specs.py, tests/test_parsers_fuzz.py)."""

from __future__ import annotations

from partita.cluster import parse_short
from partita.model import BUILTIN, LayerKind
from partita.mesh import Mesh
from partita.plan import LayerStrategy, Plan, Prediction, SolverReport, Stage, StageMemory
from partita.profile import CommCost, LayerCost, Profile, Provenance
from partita.units import GiB


def hand_profile() -> Profile:
    kind = LayerKind.of(BUILTIN["tiny-llama"], "block")
    return Profile(
        device="H100", dtype="bf16",
        provenance=Provenance(source="measured", device_name="NVIDIA H100 80GB HBM3", torch="2.11.0",
                              cuda="12.8", date="2026-11-30", command="partita profile --device cuda"),
        layers=(LayerCost(kind=kind, tp=1, micro_batch=2, seq_len=64, forward_s=1.5e-4, backward_s=3.25e-4,
                          recompute_s=1.5e-4, activation_bytes=1 << 20, param_bytes=98304, selective_recompute_s=2.5e-5),
                LayerCost(kind=LayerKind.of(BUILTIN["tiny-llama"], "head"), tp=2, micro_batch=2, seq_len=64,
                          forward_s=2e-5, backward_s=4e-5, recompute_s=0.0, activation_bytes=65536,
                          param_bytes=16384)),
        comm=(CommCost(op="all_reduce", link="nvlink", ranks=8, latency_s=1.2e-5, bandwidth_gbps=370.5),
              CommCost(op="p2p", link="network", ranks=2, latency_s=0.0, bandwidth_gbps=45.0)),
    )


def hand_plan(with_results: bool = True) -> Plan:
    model, cluster = BUILTIN["tiny-llama"], parse_short("4xcpu")
    names = model.layer_names()  # embed, layers.0..5, head
    stages = (
        Stage(index=0, group="cpu", device="cpu", ranks=(0, 1),
              layers=tuple(LayerStrategy(name=n, zero=1) for n in names[:4])),
        Stage(index=1, group="cpu", device="cpu", ranks=(2, 3),
              layers=tuple(LayerStrategy(name=n, zero=1, recompute={"layers.3": "selective", "head": "none"}.get(n, "full"))
                           for n in names[4:])),
    )
    memory = tuple(StageMemory(stage=i, device="cpu", capacity_bytes=4 * GiB, weights_bytes=400_000,
                               gradients_bytes=400_000, optimizer_bytes=1_600_000, activations_bytes=2_000_000,
                               transient_bytes=0, reserve_bytes=200 << 20) for i in range(2))
    prediction = Prediction(step_time_s=0.125, tokens_per_s=4096.0, mfu=0.31, stage_time_s=(0.01, 0.0125),
                            breakdown={"compute": 0.1, "pipeline_bubble": 0.02, "dp_comm": 0.005}, memory=memory)
    solver = SolverReport(method="cpsat", status="optimal", objective_us=125000, bound_us=125000, gap=0.0,
                          wall_s=0.4, workers=1, seed=0, ortools_version="9.12", uniform_objective_us=130000,
                          candidates=12)
    return Plan(model=model.to_dict(), model_fingerprint=model.fingerprint, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint, profile_fingerprint="analytic",
                cost_sources={"cpu": "analytic"}, dtype="fp32", seq_len=64, global_batch=8, micro_batch=1,
                num_micro_batches=4, mesh=Mesh(pp=2, dp=2, tp=1), stages=stages,
                prediction=prediction if with_results else None, solver=solver if with_results else None)
