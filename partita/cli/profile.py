"""``partita profile``: measure this machine's devices and write a profile.

    partita profile --model tiny-llama --device cpu --micro-batches 1,16 -o prof.yaml
    partita profile --model llama-3-8b --device cuda --tp 1,2,4,8 --micro-batches 1,2,4,8 -o h200.yaml
    partita profile --comm-only --device cpu --nproc 4 -o comm.yaml          # spawns 4 gloo ranks
    partita profile --model llama-3-8b --attention-only --attention-seq-lens 8192,32768 --tp 1 --cp 1,8 -o att.yaml
    torchrun --nnodes 2 --nproc-per-node 8 ... -m partita.cli profile --comm --model M -o p.yaml
    python -m partita.cli.profile --model tiny-llama --device cpu -o prof.yaml   # the same flags alone

``add_profile_arguments`` adds the flags to a parser; ``profile_command`` runs them and returns
the exit code; bad input raises ``PartitaError`` (one line, exit 2); ``main`` is the command on
its own. The measuring is ``partita.profiler``'s; this module turns flags into its options, shows
progress and prints the tables (measured against analytic: ``partita.cli.profile_compare``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path

from partita import parallel
from partita.cli.output import refuse_inputs
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.model_io import load_model
from partita.profile import Profile
from partita.units import KiB, MiB, GiB, fmt_bytes, fmt_seconds

log = logging.getLogger(__name__)

DEFAULT_TPS = (1, 2, 4, 8)
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_CPS = (1, 2, 4, 8)


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="built-in name (partita models), model YAML, or HF config.json; "
                                   "needed unless --comm-only")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--device-type", default=None,
                   help="catalog name the costs apply to (default: read from the GPU's name; cpu for the CPU)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="training dtype (default: bf16 on GPUs, fp32 on the CPU)")
    p.add_argument("--seq-len", type=str, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batches", default=None, metavar="LIST",
                   help=f"micro-batch sizes to measure, comma-separated (default {','.join(map(str, DEFAULT_MICRO_BATCHES))})")
    p.add_argument("--tp", default=None, metavar="LIST",
                   help="tensor-parallel shard widths, comma-separated (default: those of 1,2,4,8 the model divides)")
    p.add_argument("--warmup", type=str, default=None, help="untimed iterations per point (default 1 on GPUs, 2 on the CPU)")
    p.add_argument("--repeats", type=str, default=None, help="timed iterations per point; the median is kept (default 5, CPU 7)")
    p.add_argument("--threads", type=str, default=None,
                   help="CPU threads per rank (default 1: a CPU rank shares the machine with its peers)")
    p.add_argument("--comm", action="store_true", help="also measure collectives (under torchrun, or spawning --nproc ranks)")
    p.add_argument("--comm-only", action="store_true", help="measure collectives only (no --model needed)")
    p.add_argument("--nproc", type=str, default=None,
                   help="local ranks to spawn for --comm without torchrun (default: all GPUs; 4 on the CPU)")
    p.add_argument("--comm-sizes", default=None, metavar="MIN:MAX",
                   help="message sizes, e.g. 4KiB:4MiB (default 1KiB:1GiB on GPUs, 4KiB:4MiB on the CPU)")
    p.add_argument("--attention-seq-lens", default=None, metavar="LIST",
                   help="also time the causal attention core alone at these sequence lengths, comma-separated "
                        "(context parallelism's pricing at long sequences; e.g. 8192,16384,32768)")
    p.add_argument("--attention-only", action="store_true",
                   help="time the attention core only (with --attention-seq-lens; no layers)")
    p.add_argument("--cp", default=None, metavar="LIST",
                   help="context-parallel degrees whose attention shapes to time: H/(tp cp) heads over s, and H/tp "
                        "over s/cp (default: those of 1,2,4,8 the model's heads allow)")
    p.add_argument("-o", "--output", default="profile.yaml", help="where to write the profile (default profile.yaml)")


def main(argv: list[str] | None = None) -> int:
    """``python -m partita.cli.profile ...``: the same as ``partita profile ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m partita.cli.profile", description="measure layer and collective costs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and details")
    add_profile_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = ["python", "-m", "partita.cli.profile", *argv]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return profile_command(args)
    except PartitaError as e:
        print(f"partita: error: {e}", file=sys.stderr)
        return e.exit_code


def profile_command(args: argparse.Namespace) -> int:
    import torch

    from partita.profiler.provenance import catalog_device, resolve_device

    started = time.perf_counter()
    # Every flag is checked before anything is measured: bad input fails in a second.
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _check_device_type(device.type, args.device_type)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    catalog = catalog_device(device, args.device_type)
    threads = _int_flag(args.threads, "--threads", default=1) if device.type == "cpu" else None
    if args.comm_only and (args.attention_seq_lens or args.attention_only):
        raise PartitaError("--attention-seq-lens times a model's attention; drop --comm-only (use --comm with --model)")
    spec = None if args.comm_only else _model(args)
    layer_opts = None if spec is None or args.attention_only else _layer_options(args, spec, device, dtype, threads)
    attention_opts = None if spec is None else _attention_options(args, spec, device, dtype, threads)
    comm_opts = _comm_options(args, device, catalog) if (args.comm or args.comm_only) else None
    nproc = _int_flag(args.nproc, "--nproc", default=torch.cuda.device_count() if device.type == "cuda" else 4)
    output = Path(args.output)
    refuse_inputs("-o", output, [getattr(args, "model", None)])
    if output.is_dir():
        raise PartitaError(f"-o {args.output}: is a directory; give a file name, e.g. -o {output / 'profile.yaml'}")
    if not output.parent.is_dir():
        raise PartitaError(f"-o {args.output}: no such directory {str(output.parent)!r}")

    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        samples = _measure_comm(comm_opts, nproc, threads) if comm_opts else []
        if samples is None:
            return 0  # a torchrun rank other than 0: rank 0 measures the layers and writes the file
        measurements = _measure_layers(spec, layer_opts) if layer_opts else []
        attention = _measure_attention(spec, attention_opts) if attention_opts else []
        op_overhead = _measure_op_overhead(spec, device) if layer_opts else None
    finally:
        torch.set_num_threads(threads_before)
    elapsed = time.perf_counter() - started

    from partita.profiler.comm import fit_comm
    from partita.profiler.provenance import provenance

    profile = Profile(device=catalog, dtype=dtype,
                      provenance=provenance(device, dtype=dtype, command=_command_line(args), threads=threads),
                      layers=tuple(m.cost for m in measurements), comm=fit_comm(samples), attention=tuple(attention),
                      op_overhead_s=op_overhead)
    profile.save(output)
    _report(profile, measurements, samples, elapsed, args.output)
    return 0


def _measure_op_overhead(spec: ModelSpec, device) -> float:
    """The host's time per dispatched eager op on this device, on the model's block shrunk
    until its kernels take next to nothing (``runtime.commprobe.op_overhead_of``): the per-op
    floor the cost model puts under analytic layers (``search/timing.py``)."""
    from partita.runtime.commprobe import op_overhead_of

    return op_overhead_of(spec, device)


def _measure_comm(opts, nproc: int, threads: int | None) -> list | None:
    """Rank 0's samples; None on the other ranks of a torchrun job."""
    from partita.profiler import comm

    if comm.under_launcher():
        samples = comm.measure_under_launcher(opts)
        return samples if int(os.environ["RANK"]) == 0 else None
    return comm.spawn_and_measure(opts, nproc, threads_per_rank=threads or 1)


# ---- flags -> options -------------------------------------------------------------------
def _check_device_type(kind: str, device_type: str | None) -> None:
    """Costs measured on the CPU are not a GPU's, and the reverse: a profile must be labelled as
    the device it was measured on, or the planner would price that GPU with CPU timings."""
    if device_type is None:
        return
    from partita.devices import get_device

    named = get_device(device_type)
    if kind == "cpu" and not named.is_cpu:
        raise PartitaError(f"--device-type {device_type}: the costs are measured on the CPU (--device cpu), so the "
                           f"profile is the CPU's; run on the {named.name} with --device cuda, or drop --device-type")
    if kind == "cuda" and named.is_cpu:
        raise PartitaError("--device-type cpu: the costs are measured on a GPU (--device cuda); drop --device-type, "
                           "or measure the CPU with --device cpu")


def _int_flag(text: str | None, flag: str, *, default: int, minimum: int = 1) -> int:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise PartitaError(f"{flag}: expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise PartitaError(f"{flag}: expected an integer >= {minimum}, got {value}")
    return value


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise PartitaError(f"{flag}: empty list; give comma-separated positive integers, e.g. 1,2,4")
    return tuple(sorted({_int_flag(t, flag, default=0) for t in parts}))


def parse_size(text: str, flag: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB|K|M|G)?\s*", text, re.IGNORECASE)
    if not m:
        raise PartitaError(f"{flag}: cannot read size {text!r}; write e.g. 4KiB, 16MiB, 1GiB")
    unit = (m.group(2) or "B").lower()[0]
    return int(m.group(1)) * {"b": 1, "k": KiB, "m": MiB, "g": GiB}[unit]


def _model(args: argparse.Namespace) -> ModelSpec:
    if not args.model:
        raise PartitaError("--model is required (or give --comm-only to measure collectives alone)")
    return load_model(args.model)


def _layer_options(args: argparse.Namespace, spec: ModelSpec, device, dtype: str, threads: int | None):
    from partita.profiler.layers import LayerOptions

    if args.tp is None:
        tps = tuple(t for t in DEFAULT_TPS if parallel.tp_rule(spec.kinds["block"], t) is None)
    else:
        tps = parse_int_list(args.tp, "--tp")
    cpu = device.type == "cpu"
    return LayerOptions(
        device=device, dtype=dtype, seq_len=_int_flag(args.seq_len, "--seq-len", default=spec.seq_len),
        micro_batches=parse_int_list(args.micro_batches, "--micro-batches") if args.micro_batches else DEFAULT_MICRO_BATCHES,
        tps=tps, warmup=_int_flag(args.warmup, "--warmup", default=2 if cpu else 1, minimum=0),
        repeats=_int_flag(args.repeats, "--repeats", default=7 if cpu else 5), cpu_time=cpu and threads == 1)


def _attention_options(args: argparse.Namespace, spec: ModelSpec, device, dtype: str, threads: int | None):
    """The attention points to time, or None without --attention-seq-lens."""
    from partita.profiler.attention import AttentionOptions, attention_heads

    if args.attention_only and not args.attention_seq_lens:
        raise PartitaError("--attention-only needs --attention-seq-lens, e.g. --attention-seq-lens 8192,16384,32768")
    if not args.attention_seq_lens:
        return None
    tps = parse_int_list(args.tp, "--tp") if args.tp else tuple(
        t for t in DEFAULT_TPS if parallel.tp_rule(spec.kinds["block"], t) is None)
    cps = parse_int_list(args.cp, "--cp") if args.cp else DEFAULT_CPS
    cpu = device.type == "cpu"
    return AttentionOptions(device=device, dtype=dtype, seq_lens=parse_int_list(args.attention_seq_lens,
                                                                                "--attention-seq-lens"),
                            heads=attention_heads(spec, tps=tps, cps=cps), head_dim=spec.head_dim,
                            warmup=_int_flag(args.warmup, "--warmup", default=2 if cpu else 1, minimum=0),
                            repeats=_int_flag(args.repeats, "--repeats", default=7 if cpu else 5),
                            cpu_time=cpu and threads == 1)


def _comm_options(args: argparse.Namespace, device, catalog: str):
    from partita.devices import get_device
    from partita.profiler.comm import CommOptions

    cpu = device.type == "cpu"
    lo, hi = (4 * KiB, 4 * MiB) if cpu else (KiB, GiB)
    if args.comm_sizes:
        if ":" not in args.comm_sizes:
            raise PartitaError(f"--comm-sizes {args.comm_sizes!r}: write MIN:MAX, e.g. 4KiB:4MiB")
        a, b = args.comm_sizes.split(":", 1)
        lo, hi = parse_size(a, "--comm-sizes"), parse_size(b, "--comm-sizes")
        if not (64 <= lo <= hi):
            raise PartitaError(f"--comm-sizes: need 64 B <= MIN <= MAX, got {lo} and {hi} bytes")
    link = "loopback" if cpu else get_device(catalog).intra_link
    return CommOptions(device="cpu" if cpu else "cuda", intra_link=link, min_bytes=lo, max_bytes=hi)


# Flags in the order ``_command_line`` writes them back: (flag, attribute, takes a value).
_FLAGS = (("--model", "model", True), ("--device", "device", True), ("--device-type", "device_type", True),
          ("--dtype", "dtype", True), ("--seq-len", "seq_len", True), ("--micro-batches", "micro_batches", True),
          ("--tp", "tp", True), ("--warmup", "warmup", True), ("--repeats", "repeats", True),
          ("--threads", "threads", True), ("--comm", "comm", False), ("--comm-only", "comm_only", False),
          ("--nproc", "nproc", True), ("--comm-sizes", "comm_sizes", True),
          ("--attention-seq-lens", "attention_seq_lens", True), ("--attention-only", "attention_only", False),
          ("--cp", "cp", True), ("-o", "output", True))


def _command_line(args: argparse.Namespace) -> str:
    """The command that made the profile, as typed (``args.command_line``) or rebuilt from the flags."""
    argv = getattr(args, "command_line", None)
    if argv is None:
        argv = ["partita", "profile"]
        for flag, attr, takes_value in _FLAGS:
            value = getattr(args, attr, None)
            if takes_value and value is not None:
                argv += [flag, str(value)]
            elif not takes_value and value:
                argv.append(flag)
    return shlex.join(argv)


# ---- measuring with a progress bar -----------------------------------------------------------
def _measure_layers(spec: ModelSpec, opts) -> list:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from partita.profiler.layers import plan_shards, profile_layers

    shards, _ = plan_shards(spec, opts)
    total = len(shards) * len(opts.micro_batches)
    console = Console(stderr=True)
    columns = (TextColumn("[bold]profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out = []
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(spec.name, total=total)
        describe = lambda what: progress.update(task, description=f"{spec.name}: {what}")  # noqa: E731
        for m in profile_layers(spec, opts, on_point=describe):
            out.append(m)
            progress.advance(task)
    return out


def _measure_attention(spec: ModelSpec, opts) -> list:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from partita.profiler.attention import profile_attention

    columns = (TextColumn("[bold]profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out = []
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(spec.name, total=len(opts.heads) * len(opts.seq_lens))
        describe = lambda what: progress.update(task, description=f"{spec.name}: {what}")  # noqa: E731
        for point in profile_attention(opts, on_point=describe):
            out.append(point)
            progress.advance(task)
    return out


# ---- what the person sees -------------------------------------------------------------------
def _report(profile: Profile, measurements: list, samples: list, elapsed: float, output: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from partita.cli.profile_compare import compare

    console = Console()
    if measurements:
        table = Table(title=f"{profile.device} ({profile.provenance.device_name}), {profile.dtype}")
        on_gpu = any(m.allocator_bytes is not None for m in measurements)
        cols = ["layer", "tp", "micro-batch", "forward", "backward", "recompute", "selective", "activations", "params"]
        if on_gpu:
            cols.insert(8, "saved tensors")  # the allocator's count next to autograd's
        for col in cols:
            table.add_column(col, justify="left" if col == "layer" else "right")
        for m in measurements:
            c = m.cost
            row = [m.role, str(c.tp), str(c.micro_batch), fmt_seconds(c.forward_s), fmt_seconds(c.backward_s),
                   fmt_seconds(c.recompute_s) + ("*" if m.recompute_fallback else ""),
                   "-" if c.selective_recompute_s is None else fmt_seconds(c.selective_recompute_s),
                   fmt_bytes(c.activation_bytes), fmt_bytes(c.param_bytes)]
            if on_gpu:
                row.insert(8, fmt_bytes(m.saved_bytes))
            table.add_row(*row)
        console.print(table)
        if any(m.recompute_fallback for m in measurements):
            console.print("* recompute lost in timing noise; the forward time is used")
        comparisons = compare(profile.layers, profile.device, profile.dtype)
        if comparisons:
            t = Table(title="measured / analytic")
            for col in ("layer", "tp", "micro-batch", "forward", "backward", "recompute", "activations"):
                t.add_column(col, justify="left" if col == "layer" else "right")
            for c in comparisons:
                t.add_row(c.measured.kind.role, str(c.measured.tp), str(c.measured.micro_batch),
                          *(f"{c.ratio(f):.2f}" for f in ("forward_s", "backward_s", "recompute_s", "activation_bytes")))
            console.print(t)
    if profile.attention:
        from partita.profile import causal_attention_flops

        t = Table(title="causal attention core (forward FLOPs per second achieved)")
        for col in ("heads", "head_dim", "micro-batch", "sequence", "forward", "backward", "forward TFLOP/s"):
            t.add_column(col, justify="right")
        for a in profile.attention:
            flops = causal_attention_flops(a.micro_batch, a.heads, a.seq_len, a.head_dim)
            t.add_row(str(a.heads), str(a.head_dim), str(a.micro_batch), str(a.seq_len), fmt_seconds(a.forward_s),
                      fmt_seconds(a.backward_s), f"{flops / a.forward_s / 1e12:.3g}")
        console.print(t)
    if profile.comm:
        t = Table(title="collectives: time = latency + bus bytes / bandwidth")
        for col in ("op", "link", "ranks", "latency", "bandwidth"):
            t.add_column(col, justify="left" if col in ("op", "link") else "right")
        for c in profile.comm:
            t.add_row(c.op, c.link, str(c.ranks), fmt_seconds(c.latency_s), f"{c.bandwidth_gbps:.2f} GB/s")
        console.print(t)
    if profile.op_overhead_s is not None:
        console.print(f"host time per eager op: {fmt_seconds(profile.op_overhead_s)} (the per-op floor of analytic layers)")
    console.print(f"wrote {output}: {len(profile.layers)} layer points, {len(profile.attention)} attention points, "
                  f"{len(profile.comm)} collective fits "
                  f"({len(samples)} sizes measured); profiling took {elapsed:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
