"""``--resume`` when the newest checkpoint is damaged (issue 27): a truncated or overwritten
shard, a truncated ``.metadata``. The damage is found before any rank starts, named in one
warning line, and the run resumes from the newest intact checkpoint, on the same losses as a
run never interrupted.
"""

import dataclasses
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from partita.errors import PartitaError  # noqa: E402
from partita.runtime import checkpoint  # noqa: E402
from partita.runtime.train import TrainConfig, checkpoint_record  # noqa: E402
from runtime_helpers import make_plan, run_parallel  # noqa: E402

PLAN = make_plan(dp=2)
WHOLE = TrainConfig(steps=4, warmup_steps=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 4 steps with checkpoints after steps 2 and 4, and its losses."""
    ckpt = tmp_path_factory.mktemp("run") / "ckpt"
    losses, _ = run_parallel(PLAN, dataclasses.replace(WHOLE, checkpoint_dir=str(ckpt), checkpoint_every=2))
    assert checkpoint.latest_step(ckpt) == 4 and checkpoint.damage(ckpt, 4) is None
    return ckpt, losses


def _shard(step_dir):
    return sorted(step_dir.glob("*.distcp"))[0]


def _truncate_shard(d):
    p = _shard(d)
    os.truncate(p, p.stat().st_size // 2)


def _overwrite_shard(d):
    p = _shard(d)
    p.write_bytes(os.urandom(p.stat().st_size))  # the same size, other bytes


def _truncate_metadata(d):
    p = d / ".metadata"
    os.truncate(p, p.stat().st_size // 3)


@pytest.mark.parametrize("damage, phrase", [(_truncate_shard, "is truncated"), (_overwrite_shard, "is damaged"),
                                            (_truncate_metadata, ".metadata does not read")])
def test_the_damaged_step_is_named_and_the_older_one_used(damage, phrase, saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    damage(ckpt / "step-000004")
    step, warnings = checkpoint.check_resume(ckpt, checkpoint_record(PLAN, dataclasses.replace(WHOLE, steps=6), 0))
    assert step == 2
    assert len(warnings) == 2, warnings  # the damage, then --steps 4 -> 6
    assert warnings[0].startswith("--resume: checkpoint step-000004 is damaged: step-000004/") and phrase in warnings[0]
    assert warnings[0].endswith("; resuming from step-000002") and "\n" not in warnings[0]


def test_no_intact_checkpoint_is_one_line(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    for step in (2, 4):
        _truncate_shard(ckpt / f"step-00000{step}")
    with pytest.raises(PartitaError, match="no intact checkpoint in .*give another --checkpoint-dir or drop --resume"):
        checkpoint.check_resume(ckpt, checkpoint_record(PLAN, WHOLE, 0))


def test_resuming_past_a_damaged_checkpoint_trains_the_same_losses(saved, tmp_path):
    """The ranks resume from step 2, not the damaged step 4, and train steps 3 and 4 as the
    uninterrupted run did."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    _truncate_shard(ckpt / "step-000004")
    os.unlink(ckpt / "step-000004" / "partita.json")  # (the record alone would not make it whole)
    tail, _ = run_parallel(PLAN, dataclasses.replace(WHOLE, steps=4, checkpoint_dir=str(ckpt), resume=True))
    assert tail == pytest.approx(saved[1][2:], rel=1e-6)
