"""Plan files of schema 1 (degrees at the top level, written by Partita before the mesh) still
show, check, export and launch: ``partita.plan.migrate`` reads them as schema 2.

The files in tests/data/schema1/ were written by `partita plan` at the last commit of schema 1,
one per dimension of the space: a CPU plan, an interleaved pipeline, context parallelism,
expert parallelism, and replicas on two device types.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from partita.cli import main
from partita.plan import SCHEMA_VERSION, Plan, migrate

SCHEMA1 = sorted((Path(__file__).parent / "data" / "schema1").glob("*.yaml"))


@pytest.mark.parametrize("path", SCHEMA1, ids=lambda p: p.stem)
def test_a_schema_1_plan_reads_as_schema_2_with_the_same_degrees(path):
    old = yaml.safe_load(path.read_text())
    assert old["schema_version"] == 1 and "mesh" not in old
    plan = Plan.load(path)
    degrees = {k: old.get(k, 1) for k in ("pp", "dp", "cp", "tp", "ep")}
    assert plan.mesh.to_dict() == degrees
    new = plan.to_dict()
    assert new["schema_version"] == SCHEMA_VERSION and new["mesh"] == degrees
    assert not {"dp", "tp", "pp", "cp", "ep"} & set(new)
    assert Plan.from_dict(new) == plan
    assert [l.to_dict() for l in plan.layer_strategies()] == [
        l for s in old["stages"] for l in s["layers"]] or plan.virtual_stages > 1  # (interleaved: pipeline order)


@pytest.mark.parametrize("path", SCHEMA1, ids=lambda p: p.stem)
def test_a_schema_1_plan_shows_checks_and_exports(path, tmp_path, capsys):
    cluster = yaml.safe_load(path.read_text())["cluster"]["name"]
    assert main(["show", str(path)]) == 0
    assert main(["check", str(path), "--cluster", cluster]) == 0
    capsys.readouterr()
    # Every export reads the old file as it reads the same plan written as schema 2 (a plan whose
    # replicas sit on two device types exits 2 for Megatron either way: it runs replicas alike;
    # a mixture of experts exits 2 for torchtitan and DeepSpeed, which cannot train its experts).
    new = tmp_path / "schema2.yaml"
    Plan.load(path).save(new)
    for target in ("megatron", "torchtitan", "deepspeed"):
        codes, texts = [], []
        for source in (path, new):
            out = tmp_path / f"{target}-{source.stem}.out"
            codes.append(main(["export", str(source), "--to", target, "-o", str(out)]))
            texts.append(out.read_text().replace(str(source), "PLAN") if out.exists() else None)
            capsys.readouterr()
        assert codes[0] == codes[1] and texts[0] == texts[1], target
        assert codes[0] == 0 or "replicas" in path.stem or ("mixtral" in path.stem and target != "megatron")


def test_a_schema_1_plan_launches(tmp_path):
    path = next(p for p in SCHEMA1 if p.stem == "tiny-llama-4xcpu")
    assert main(["launch", str(path), "--steps", "1", "--metrics", str(tmp_path / "run" / "metrics.jsonl")]) == 0


def test_the_migration_refuses_what_it_does_not_know():
    with pytest.raises(Exception, match="schema_version 7 is not supported"):
        migrate({"schema_version": 7})
    with pytest.raises(Exception, match="missing key 'dp'"):
        migrate({"schema_version": 1, "tp": 1, "pp": 1})
