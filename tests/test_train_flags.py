"""The optimizer and schedule flags of `partita launch` reach the ranks (the worker parses the
launcher's own arguments) and bad values are one line each."""

import argparse

import pytest

pytest.importorskip("torch")

from partita.errors import PartitaError  # noqa: E402
from partita.runtime.launch import add_launch_arguments, train_config, worker_arguments  # noqa: E402
from partita.runtime.train import TrainConfig, check_config  # noqa: E402


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(["plan.yaml", *map(str, argv)])


def test_defaults_are_the_documented_ones_and_given_values_reach_the_worker():
    cfg = train_config(parse())
    assert (cfg.min_lr_ratio, cfg.weight_decay, cfg.betas, cfg.grad_clip) == (0.1, 0.1, (0.9, 0.95), 1.0)
    assert "--betas" not in worker_arguments(parse(), "m.jsonl")  # defaults are the worker's own
    args = parse("--weight-decay", 0.01, "--betas", "0.9,0.999", "--grad-clip", 0.5, "--min-lr-ratio", 0.0)
    cfg = train_config(args)
    assert (cfg.weight_decay, cfg.betas, cfg.grad_clip, cfg.min_lr_ratio) == (0.01, (0.9, 0.999), 0.5, 0.0)
    again = train_config(parse(*worker_arguments(args, "m.jsonl")[1:]))
    assert (again.weight_decay, again.betas, again.grad_clip, again.min_lr_ratio) == (0.01, (0.9, 0.999), 0.5, 0.0)


@pytest.mark.parametrize("field,value,phrase", [("betas", (0.9, 1.0), "--betas"), ("grad_clip", 0.0, "--grad-clip"),
                                                ("weight_decay", -1.0, "--weight-decay"),
                                                ("min_lr_ratio", 2.0, "--min-lr-ratio")])
def test_bad_values_are_one_line(field, value, phrase):
    with pytest.raises(PartitaError, match=phrase):
        check_config(TrainConfig(**{field: value}))
