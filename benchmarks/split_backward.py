"""The host cost of the zero-bubble schedules' split backward, measured.

    python benchmarks/split_backward.py [--device cpu|cuda] [--model tiny-llama] [--full MODEL:B ...] [--json F]

Torch's zero-bubble schedules (interleaved zero-bubble, ZB-V) run a stage's backward in two
passes: ``stage_backward_input`` (I) walks the autograd graph once to group the parameters by
the intermediates their gradients come from, and computes the input gradient with the graph
kept; ``stage_backward_weight`` (W) then calls ``torch.autograd.grad`` once per parameter group.
Each of those calls is a graph task of its own, and the engine first walks every node reachable
from its roots, which after I is most of the stage's graph. So besides the same kernels, a split
backward costs per parameter group a fixed host time (the Python around the call, the engine's
start) and a walk over the stage's nodes: ``groups x (A + B x nodes)`` op overheads, with
``groups`` the parameter tensors of the (virtual) stage and ``nodes`` its forward's eager ops.

This script measures it on the host alone: a stack of L blocks shrunk until their kernels take
next to nothing (the same modules, hence the same ops and autograd graph; the shrunk model the
per-op overhead is measured on, ``runtime.commprobe.probe_spec``), L = 1, 2, 4, 8, 16; for
each, the median over interleaved repeats of one plain backward and one split backward (time
spent waiting for a core taken off, ``runtime.phases.RunQueueDelay``); the per-op overhead of the
same stacks' plain forward and backward; and the least-squares A and B. ``--full`` also times
full-size stacks of a model at a micro-batch (e.g. ``--full benchmarks/data/calib-llama.yaml:4``)
to show what the host term does not cover there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from partita.model_io import load_model
from partita.runtime.commprobe import OpCounter, probe_spec
from partita.runtime.models import build_layer, init_layer
from partita.runtime.phases import RunQueueDelay

BLOCKS = (1, 2, 4, 8, 16)


def measure(spec, n_blocks: int, batch: int, device: torch.device, repeats: int) -> dict:
    blocks = nn.ModuleList(build_layer(spec, "block", device=device) for _ in range(n_blocks))
    for i, block in enumerate(blocks):
        init_layer(block, f"layers.{i}", 0, n_layers=n_blocks)
    params = list(blocks.parameters())
    grad = torch.randn(batch, spec.seq_len, spec.hidden, device=device)

    def forward():
        x = torch.randn(batch, spec.seq_len, spec.hidden, device=device, requires_grad=True)
        y = x
        for block in blocks:
            y = block(y)
        return x, y

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    delay = RunQueueDelay()

    def timed(fn) -> float:
        sync()
        t0, d0 = time.perf_counter(), delay.seconds()
        fn()
        sync()
        return time.perf_counter() - t0 - (delay.seconds() - d0)

    def plain():
        x, y = forward()
        return timed(lambda: torch.autograd.backward([y], [grad]))

    def split():
        x, y = forward()

        def run():
            _, groups = stage_backward_input([y], [grad], [x], iter(params))
            stage_backward_weight(iter(params), groups)
        return timed(run)

    def whole():  # forward and plain backward, for the per-op overhead
        return timed(lambda: torch.autograd.backward([forward()[1]], [grad]))

    with OpCounter() as counter:
        forward()
    forward_ops = counter.ops
    with OpCounter() as counter:
        torch.autograd.backward([forward()[1]], [grad])
    all_ops = counter.ops
    for _ in range(3):
        plain(), split(), whole()
    p, s, w = [], [], []
    for _ in range(repeats):  # interleaved: load that comes and goes hits all three alike
        p.append(plain())
        s.append(split())
        w.append(whole())
    return dict(blocks=n_blocks, groups=len(params), nodes=forward_ops, plain_s=statistics.median(p),
                split_s=statistics.median(s), extra_s=statistics.median(s) - statistics.median(p),
                op_overhead_s=statistics.median(w) / all_ops)


def fit(rows: list[dict], op_overhead_s: float) -> tuple[float, float]:
    """Least squares of extra / op overhead = groups x (A + B x nodes), relative errors weighted
    alike (each row divided by its measurement)."""
    y = np.array([r["extra_s"] / op_overhead_s for r in rows])
    x = np.array([[r["groups"], r["groups"] * r["nodes"]] for r in rows], dtype=float)
    (a, b), *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return float(a), float(b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--full", nargs="*", default=[], metavar="MODEL:B",
                    help="also time full-size stacks of MODEL at micro-batch B")
    ap.add_argument("--json", help="write the measurements and the fit here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a CPU rank runs
    torch.manual_seed(0)
    spec = probe_spec(load_model(args.model))
    rows = [measure(spec, n, 1, device, args.repeats) for n in BLOCKS]
    overhead = statistics.median(r["op_overhead_s"] for r in rows)
    a, b = fit(rows, overhead)
    print(f"split backward on {device} ({torch.__version__}), {args.model} blocks shrunk to hidden {spec.hidden}; "
          f"per-op overhead {overhead * 1e6:.2f} us")
    print("| blocks | groups | nodes | plain | split | extra | model | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        model = r["groups"] * (a + b * r["nodes"]) * overhead
        r["model_s"] = model
        print(f"| {r['blocks']} | {r['groups']} | {r['nodes']} | {r['plain_s'] * 1e3:.2f} ms | {r['split_s'] * 1e3:.2f} ms"
              f" | {r['extra_s'] * 1e3:.2f} ms | {model * 1e3:.2f} ms | {100 * (model / r['extra_s'] - 1):+.1f} % |")
    print(f"A = {a:.2f} op overheads per group, B = {b:.4f} op overheads per group and node")
    full = []
    for item in args.full:
        name, _, batch = item.rpartition(":")
        big = load_model(name)
        for n in (1, 2, 4):
            r = measure(big, n, int(batch), device, max(5, args.repeats // 3))
            r.update(model=name, batch=int(batch), host_term_s=r["groups"] * (a + b * r["nodes"]) * overhead)
            full.append(r)
            print(f"full {name} b={batch} blocks {n}: plain {r['plain_s'] * 1e3:.2f} ms, split {r['split_s'] * 1e3:.2f} ms,"
                  f" extra {r['extra_s'] * 1e3:.2f} ms ({100 * r['extra_s'] / r['plain_s']:+.1f} %),"
                  f" host term {r['host_term_s'] * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), torch=torch.__version__, model=args.model, op_overhead_s=overhead,
                           a=a, b=b, rows=rows, full=full), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
