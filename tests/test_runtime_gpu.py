"""GPU runs of the runtime (NCCL, bf16). Skipped without at least two CUDA devices, never faked."""

import argparse
import json

import pytest

torch = pytest.importorskip("torch")

from partita.devices import CATALOG  # noqa: E402
from partita.runtime.launch import _same_device, add_launch_arguments, launch_command  # noqa: E402
from partita.runtime.train import TrainConfig  # noqa: E402
from runtime_helpers import make_plan, run_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


def _catalog_name() -> str:
    name = torch.cuda.get_device_name(0)
    matches = [d for d in CATALOG if d != "cpu" and _same_device(d, name)]
    if not matches:
        pytest.skip(f"{name} is not in the device catalog")
    return max(matches, key=len)


@pytest.mark.parametrize("layout", ["tp-sp", "fsdp", "pp"])
def test_bf16_run_on_two_gpus_tracks_the_fp32_reference(tmp_path, layout):
    cluster = f"2x{_catalog_name()}"
    plan = {
        "tp-sp": lambda: make_plan(tp=2, layer=dict(tensor_parallel=2, sequence_parallel=True), cluster=cluster,
                                   dtype="bf16", seq_len=64),
        "fsdp": lambda: make_plan(dp=2, layer=dict(zero=3, recompute="full"), cluster=cluster, dtype="bf16", seq_len=64),
        "pp": lambda: make_plan(pp=2, boundaries=[2], num_micro_batches=4, cluster=cluster, dtype="bf16", seq_len=64),
    }[layout]()
    path = tmp_path / "plan.yaml"
    plan.save(path)
    metrics = tmp_path / "metrics.jsonl"
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    steps = 5
    assert launch_command(parser.parse_args([str(path), "--steps", str(steps), "--metrics", str(metrics)])) == 0
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["rank"] == 0]
    reference, _ = run_reference(plan, TrainConfig(steps=steps))
    # bf16 compute: the losses follow the fp32 run to within a few percent, and fall.
    assert losses == pytest.approx(reference, rel=3e-2)
    assert losses[-1] < losses[0]
