"""partita export of context-parallel plans: Megatron's --context-parallel-size with
--cp-comm-type a2a / p2p, torchtitan's context_parallel_degree (the ring only), DeepSpeed's
Ulysses sequence_parallel_size (the all-to-all only); a variant the target lacks exports as the
other, priced, with the change listed; what no target variant can run is one line. The
targets' own parsers are used where they install (torchtitan 0.2.2, DeepSpeed 0.19.8)."""

import dataclasses
import json
import re
import shlex
import tomllib

import pytest

from partita.cli import main
from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.cli.export import describe_changes, export_plan
from partita.cli.export_megatron import arguments
from partita.model import BUILTIN
from partita.mesh import Mesh
from partita.plan import LayerStrategy, Plan, Stage
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.plans import attach_prediction

LLAMA8 = BUILTIN["llama-3-8b"]  # 32 heads, 8 kv heads


def cp_plan(*, cp: int = 4, variant: str = "all_to_all", dp: int = 2, tp: int = 1, seq_len: int = 32768,
            zero: int = 1) -> Plan:
    """One stage of dp x cp x tp ranks on one 8xH100 node, every layer alike."""
    clus = parse_short("8xH100")
    group = clus.groups[0]
    layers = tuple(LayerStrategy(name=n, tensor_parallel=tp, sequence_parallel=tp > 1, zero=zero)
                   for n in LLAMA8.layer_names())
    stage = Stage(index=0, group=group.name, device=group.device, ranks=tuple(range(dp * cp * tp)), layers=layers)
    return Plan(model=LLAMA8.to_dict(), model_fingerprint=LLAMA8.fingerprint, cluster=clus.to_dict(),
                cluster_fingerprint=clus.fingerprint, profile_fingerprint="analytic", cost_sources={"H100": "analytic"},
                dtype="bf16", seq_len=seq_len, global_batch=dp * 2, micro_batch=1, num_micro_batches=2,
                mesh=Mesh(pp=1, dp=dp, cp=cp, tp=tp), cp_variant=variant, stages=(stage,))


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("variant, comm_type", [("all_to_all", "a2a"), ("ring", "p2p"), ("all_gather", "allgather")])
def test_megatron_runs_every_variant_exactly(variant, comm_type):
    ex = export_plan(cp_plan(variant=variant), "megatron")
    assert ex.changes == ()
    # the same plan, priced as Megatron runs it (search/engines.py)
    plan = dataclasses.replace(cp_plan(variant=variant), engine="megatron")
    cm = CostModel(LLAMA8, plan.cluster_spec, seq_len=plan.seq_len, dtype=plan.dtype, engine=ENGINES["megatron"])
    assert ex.exported.prediction.step_time_s == pytest.approx(attach_prediction(plan, cm).prediction.step_time_s)
    argv = arguments(ex.exported, LLAMA8)
    assert _value(argv, "--context-parallel-size") == "4" and _value(argv, "--cp-comm-type") == comm_type
    assert "# Megatron-LM arguments for llama-3-8b: dp 2 x cp 4 x tp 1 x pp 1 = 8 ranks" in ex.text
    # one flag a line, as the other flags: the file reads back to the same argv
    lines = [l for l in ex.text.splitlines() if not l.startswith("#")]
    assert [t for l in lines for t in shlex.split(l)] == argv


def test_megatron_refuses_a_sequence_its_load_balancing_cannot_cut():
    # 4 x 3 = 12 tokens: the all-to-all splits them (12 % 4), Megatron wants 2 x cp = 8 to divide them
    with pytest.raises(PartitaError, match=r"divisible by 2 x cp = 8"):
        export_plan(cp_plan(seq_len=12), "megatron")


def test_torchtitan_runs_the_ring_with_rotate_alltoall():
    ex = export_plan(cp_plan(variant="ring", zero=3), "torchtitan")
    assert ex.changes == ()
    data = tomllib.loads(ex.text)
    par = data["parallelism"]
    assert par["context_parallel_degree"] == 4 and par["context_parallel_rotate_method"] == "alltoall"
    assert par["data_parallel_shard_degree"] == 2 and par["data_parallel_replicate_degree"] == 1
    assert par["fsdp_reshard_after_forward"] == "always"
    override_line = next(l for l in ex.text.splitlines() if "torchtitan >= 0.3" in l)
    assert "--parallelism.context_parallel_degree 4" in override_line and "rotate" not in override_line


def test_torchtitan_exports_an_all_to_all_plan_as_the_ring_and_says_so(tmp_path, capsys, monkeypatch,
                                                                      torchtitan_config_manager):
    path = tmp_path / "a2a.yaml"
    cp_plan(variant="all_to_all", zero=1).save(path)
    out = tmp_path / "job.toml"
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "context parallelism (cp 4) all-to-all -> ring" in text
    assert "ZeRO level: 1 on all 34 layers -> " in text  # torchtitan runs FSDP whenever cp > 1
    assert re.search(r"^torchtitan export: +step", text, re.M)
    par = tomllib.loads(out.read_text())["parallelism"]
    assert par["context_parallel_degree"] == 4 and par["data_parallel_shard_degree"] == 2
    cfg = torchtitan_config_manager().ConfigManager().parse_args(["--job.config_file", str(out)])
    assert cfg.parallelism.context_parallel_degree == 4
    assert cfg.parallelism.context_parallel_rotate_method == "alltoall"
    assert cfg.parallelism.context_parallel_load_balancer == "headtail"  # torchtitan's default, Partita's layout


def test_torchtitan_refuses_an_all_to_all_plan_the_ring_cannot_run():
    with pytest.raises(PartitaError, match=r"--to torchtitan: .*runs ring only.*divisible by 2 x cp = 8"):
        export_plan(cp_plan(seq_len=12), "torchtitan")


def test_deepspeed_runs_the_all_to_all_as_ulysses(tmp_path):
    ex = export_plan(cp_plan(variant="all_to_all", zero=2), "deepspeed")
    assert ex.changes == ()
    data = json.loads(ex.text)
    assert data["sequence_parallel_size"] == 4 and data["data_parallel_size"] == 2
    assert data["zero_optimization"]["stage"] == 2
    assert any("DistributedAttention" in n for n in ex.notes)
    config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed not installed")
    ds = config.DeepSpeedConfig(data)
    assert ds.zero_optimization_stage == 2 and ds.train_micro_batch_size_per_gpu == 1


def test_deepspeed_exports_a_ring_plan_as_the_all_to_all():
    ex = export_plan(cp_plan(variant="ring", zero=1), "deepspeed")
    assert ex.exported.cp_variant == "all_to_all"
    assert "context parallelism (cp 4) ring -> all-to-all" in ex.changes


def test_deepspeed_refuses_cp_beside_tensor_parallelism_in_one_line(tmp_path, capsys):
    path = tmp_path / "tp.yaml"
    cp_plan(dp=1, tp=2).save(path)
    assert main(["export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data x sequence parallel only" in err[0] and "tp 2" in err[0]
    assert not (tmp_path / "ds.json").exists()


def test_plans_without_cp_list_no_cp_change():
    plan = cp_plan(cp=1, dp=8)
    assert describe_changes(plan, plan) == []
