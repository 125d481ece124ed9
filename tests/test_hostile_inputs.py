"""Hostile inputs and faults (issue 27): files that would never end, explode or exhaust memory,
absurd numbers, an output that is one of the inputs, a full disk, a signal during the search.
Each is refused with one line on stderr and exit 2 (130 or 143 for a signal) within 20 s, with
no traceback, and every file that existed before is unchanged. And device memory is one figure.

Cases run ``partita.cli.main`` in-process; one runs the whole program in a subprocess.
"""

import errno
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from partita import fileio, specio
from partita.cli import main
from partita.cluster import load_cluster
from partita.errors import PartitaError
from partita.model_io import load_model

TINY = ["--model", "tiny-llama", "--cluster", "4xcpu"]


def alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases: a few hundred bytes that expand to 9**10 nodes."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    assert main(["plan", *TINY, "--search", "uniform", "-o", str(d / "plan.yaml")]) == 0
    (d / "bomb.yaml").write_text(alias_bomb())
    (d / "bomb.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "loop.yaml").write_text("a: &a [*a]\n")
    (d / "deep.yaml").write_text("[" * 200 + "]" * 200 + "\n")
    with open(d / "big.yaml", "wb") as f:  # 17 MiB of one comment: harmless but for its size
        f.write(b"#" + b"x" * (17 * 1024 * 1024) + b"\n")
    with open(d / "config.json", "wb") as f:
        f.write(b'{"model_type": "llama", "pad": "' + b"x" * (17 * 1024 * 1024) + b'"}')
    os.mkfifo(d / "fifo.yaml")
    return d


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# (argv with {d} for the files folder, a phrase the one line must hold)
CASES = [
    # the alias bomb, wherever a file is read
    (["show", "{d}/bomb.yaml"], "aliases expand to more than 10,000 nodes"),
    (["check", "{d}/bomb.yaml", "--cluster", "4xcpu"], "aliases expand to more than 10,000 nodes"),
    (["launch", "{d}/bomb.yaml"], "aliases expand to more than 10,000 nodes"),
    (["export", "{d}/bomb.yaml", "--to", "megatron", "-o", "{d}/out.args"], "aliases expand to more than 10,000"),
    (["plan", "--model", "{d}/bomb.yaml", "--cluster", "4xcpu"], "aliases expand to more than 10,000 nodes"),
    (["plan", "--model", "tiny-llama", "--cluster", "{d}/bomb.yaml"], "aliases expand to more than 10,000 nodes"),
    (["plan", *TINY, "--profile", "{d}/bomb.yaml"], "aliases expand to more than 10,000 nodes"),
    (["launch", "{d}/plan.yaml", "--model", "{d}/bomb.yaml"], "aliases expand to more than 10,000 nodes"),
    (["show", "{d}/loop.yaml"], "an alias refers to a node that contains it"),
    (["show", "{d}/deep.yaml"], "nested deeper than 64"),
    (["plan", "--model", "{d}/bomb.json", "--cluster", "4xcpu"], "malformed JSON (nested deeper than 64)"),
    # the size cap
    (["show", "{d}/big.yaml"], "larger than 16 MiB"),
    (["launch", "{d}/big.yaml"], "larger than 16 MiB"),
    (["plan", "--model", "{d}/big.yaml", "--cluster", "4xcpu"], "larger than 16 MiB"),
    (["plan", "--model", "{d}/config.json", "--cluster", "4xcpu"], "larger than 16 MiB"),
    # only regular files
    (["show", "/dev/zero"], "/dev/zero: cannot read (a device, not a regular file)"),
    (["plan", "--model", "/dev/zero", "--cluster", "4xcpu"], "a device, not a regular file"),
    (["plan", "--model", "tiny-llama", "--cluster", "/dev/zero"], "cannot read"),
    (["launch", "/dev/zero"], "a device, not a regular file"),
    (["show", "{d}/fifo.yaml"], "a FIFO, not a regular file"),
    (["show", "{d}"], "a directory, not a regular file"),
    # absurd numbers
    (["plan", *TINY, "--global-batch=1000000000000000000000000000000"], "--global-batch must be between 1 and"),
    (["plan", *TINY, "--seed=100000000000000000000000"], "--seed must be between 0 and 2,147,483,647"),
    (["plan", *TINY, "--seed=-1"], "--seed must be between 0"),
    (["plan", *TINY, "--seq-len=100000000000000000000"], "--seq-len must be between 1 and 16,777,216"),
    (["plan", *TINY, "--moe-imbalance", "0"], "--moe-imbalance is the busiest rank's tokens over the mean"),
    (["plan", *TINY, "--moe-imbalance", "inf"], "a finite number >= 1"),
    (["launch", "{d}/plan.yaml", "--steps=1000000000000000000000000000000"], "--steps must be at least 1 and at most"),
    # an output that is one of the inputs
    (["export", "{d}/plan.yaml", "--to", "megatron", "-o", "{d}/plan.yaml"], "is the input"),
    (["export", "{d}/plan.yaml", "--to", "deepspeed", "-o", "{d}/plan.yaml"], "is the input"),
    (["plan", *TINY, "--profile", "{d}/plan.yaml", "-o", "{d}/plan.yaml"], "is the input"),
    (["plan", "--model", "{d}/plan.yaml", "--cluster", "4xcpu", "-o", "{d}/plan.yaml"], "is the input"),
    (["launch", "{d}/plan.yaml", "--metrics", "{d}/plan.yaml"], "is the input"),
    (["launch", "{d}/plan.yaml", "--emit", "slurm", "-o", "{d}/plan.yaml"], "is the input"),
    # a full disk
    (["plan", *TINY, "--search", "uniform", "-o", "/dev/full"], "no space left on device writing /dev/full"),
    (["export", "{d}/plan.yaml", "--to", "megatron", "-o", "/dev/full"], "no space left on device writing /dev/full"),
    (["launch", "{d}/plan.yaml", "--emit", "slurm", "-o", "/dev/full"], "no space left on device writing /dev/full"),
]


@pytest.mark.parametrize("argv, phrase", CASES, ids=[" ".join(c[0])[:70] for c in CASES])
def test_hostile_input_is_one_line(argv, phrase, files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", _no_process)  # refused before anything starts
    before = _snapshot(files)
    argv = [a.replace("{d}", str(files)) for a in argv]
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 20  # the bound; most take well under a second
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("partita: error:") and phrase in err, err
    assert _snapshot(files) == before  # nothing overwritten, nothing new beside the inputs
    assert not list(tmp_path.iterdir())


def _no_process(*args, **kwargs):
    raise AssertionError(f"a hostile input started a process: {args}")


def test_the_whole_program_refuses_the_bomb_at_once(files):
    for args in (["show", str(files / "bomb.yaml")], ["show", "/dev/zero"]):
        start = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert time.perf_counter() - start < 20


# ---- the loader's bounds, directly ---------------------------------------------------------
def test_a_few_aliases_are_fine():
    text = "base: &b {device: H100, nodes: 2}\ngroups: [*b, *b, {<<: *b, nodes: 4}]\n"
    data = specio.parse_yaml(text)
    assert data["groups"][2] == {"device": "H100", "nodes": 4}
    # a bomb two levels short of the limit is read; the next level is refused
    assert len(specio.parse_yaml(alias_bomb(levels=3))["a3"]) == 9
    with pytest.raises(PartitaError, match="10,000 nodes"):
        specio.parse_yaml(alias_bomb(levels=4))


def test_depth_bound_is_64():
    specio.parse_yaml("[" * 64 + "]" * 64)
    with pytest.raises(PartitaError, match="nested deeper than 64"):
        specio.parse_yaml("[" * 65 + "]" * 65)
    # aliases cannot nest deeper than the text does
    deep = "[" * 40 + "]" * 40
    with pytest.raises(PartitaError, match="nested deeper than 64"):
        specio.parse_yaml(f"a: &a {deep}\nb: [[[[[[[[[[[[[[[[[[[[[[[[[[[[[*a]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n")
    fileio.parse_json("[" * 64 + "]" * 64)
    with pytest.raises(PartitaError, match="nested deeper than 64"):
        fileio.parse_json("[" * 65 + "]" * 65)


def test_the_cap_is_exact(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_bytes(b"#" * 99 + b"\n")
    assert fileio.read_bytes(p, limit=100) == b"#" * 99 + b"\n"
    p.write_bytes(b"#" * 100 + b"\n")
    with pytest.raises(PartitaError, match="larger than"):
        fileio.read_bytes(p, limit=100)


# ---- numbers YAML 1.1 reads as strings -----------------------------------------------------
def test_exponents_without_a_dot_are_numbers(tmp_path):
    assert specio.parse_yaml("a: 1e-5\nb: 5e1\nc: -2E+3\nd: 1.0e5\ne: .5e1\nf: '1e5'\ng: 1e\n") == {
        "a": 1e-5, "b": 50.0, "c": -2000.0, "d": 1e5, "e": 5.0, "f": "1e5", "g": "1e"}
    # a string that reads like one is quoted when written, so it stays a string
    assert specio.parse_yaml(specio.dump_yaml({"name": "1e5", "x": 1e-5})) == {"name": "1e5", "x": 1e-5}
    model = yaml.safe_load((Path(__file__).parents[1] / "configs/models/llama-1b.yaml").read_text())
    text = specio.dump_yaml(model).replace("norm_eps: 1.0e-05", "norm_eps: 1e-5")
    assert "norm_eps: 1e-5" in text
    (tmp_path / "m.yaml").write_text(text)
    assert load_model(str(tmp_path / "m.yaml")).norm_eps == 1e-5
    cluster = (Path(__file__).parents[1] / "configs/clusters/mixed-h100-a100.yaml").read_text()
    (tmp_path / "c.yaml").write_text(cluster.replace("network_gbps: 50", "network_gbps: 5e1"))
    assert load_cluster(str(tmp_path / "c.yaml")).groups[0].network_gbps == 50.0


# ---- writing: whole or not at all ----------------------------------------------------------
def test_a_full_disk_keeps_the_old_plan(files, tmp_path, monkeypatch, capsys):
    """ENOSPC while the new plan is written: one line, exit 2, the old plan as it was, no
    temporary file left behind."""
    out = tmp_path / "plan.yaml"
    out.write_bytes((files / "plan.yaml").read_bytes())
    os.chmod(out, 0o640)
    old = out.read_bytes()
    real_write = os.write

    def full(fd, data):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".plan.yaml."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert main(["plan", *TINY, "--search", "uniform", "--global-batch", "4", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"partita: error: no space left on device writing {out}\n"
    assert out.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]
    monkeypatch.setattr(os, "write", real_write)
    assert main(["plan", *TINY, "--search", "uniform", "--global-batch", "4", "-o", str(out)]) == 0
    assert out.read_bytes() != old and yaml.safe_load(out.read_text())["global_batch"] == 4
    assert os.stat(out).st_mode & 0o777 == 0o640  # the file keeps its permissions
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_write_text_through_a_link(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    fileio.write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    with pytest.raises(PartitaError, match="is a directory"):
        fileio.write_text(tmp_path, "x")
    with pytest.raises(PartitaError, match="cannot write"):
        fileio.write_text(tmp_path / "no" / "such" / "dir.txt", "x")


# ---- signals during the CP-SAT search ------------------------------------------------------
def _hard_model():
    """A model CP-SAT does not finish in a minute (60 queens, minimising a weighted sum)."""
    from ortools.sat.python import cp_model

    m, n = cp_model.CpModel(), 60
    x = [m.new_int_var(0, n - 1, f"x{i}") for i in range(n)]
    m.add_all_different(x)
    m.add_all_different([x[i] + i for i in range(n)])
    m.add_all_different([x[i] - i for i in range(n)])
    m.minimize(sum(x[i] * ((i * 7919) % 13) for i in range(n)))
    return m


@pytest.mark.parametrize("signum, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_stops_the_cp_sat_search(signum, code, tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM while CP-SAT solves: the search stops at once (CP-SAT's own SIGINT
    handler would only end that one solve, and the search went on and exited 0), exit 130 or
    143, one line, and no plan written. The first solve is given a model that runs for a minute,
    and the signal comes half a second into it."""
    import signal
    import threading

    from partita.search import cpsat

    real = cpsat._solve_interruptibly
    calls = []

    def slow_first_solve(solver, model):
        if not calls:
            calls.append(time.perf_counter())
            solver.parameters.max_time_in_seconds = 60
            solver.parameters.max_deterministic_time = 1e9  # the search's work limit would end it early
            threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, signum))).start()
            return real(solver, _hard_model())
        return real(solver, model)

    monkeypatch.setattr(cpsat, "_solve_interruptibly", slow_first_solve)
    # A shell's background job starts with SIGINT ignored, and Python then installs no handler of
    # its own: Ctrl-C's handler as an interactive `partita plan` has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "plan.yaml"
    if signum == "SIGINT":
        assert main(["plan", *TINY, "-o", str(out)]) == code
    else:
        with pytest.raises(SystemExit) as stopped:
            main(["plan", *TINY, "-o", str(out)])
        assert stopped.value.code == code
    assert calls and time.perf_counter() - calls[0] < 5
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.strip() == ("partita: interrupted" if signum == "SIGINT" else "partita: stopped by SIGTERM")
    assert not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is the plan command's alone
    signal.signal(signal.SIGINT, previous)


# ---- device memory: one figure ---------------------------------------------------------------
def test_the_datasheet_memory_is_the_catalog_memory(tmp_path, capsys):
    """A cluster YAML writing an H100's datasheet 80 (GB) is the short form's 8xH100 (the
    driver's 79.65 GiB), the same hardware with the same fingerprint; other figures stay."""
    from partita.cluster import ClusterSpec, same_hardware
    from partita.devices import get_device
    from partita.units import GiB

    short = load_cluster("8xH100")
    for written in (80, 79.65, 79.6474609375):
        yaml_form = ClusterSpec.from_dict({"groups": [{"device": "H100", "gpus_per_node": 8, "memory_gib": written}]})
        assert yaml_form.fingerprint == short.fingerprint and same_hardware(yaml_form, short), written
    held_back = ClusterSpec.from_dict({"groups": [{"device": "H100", "gpus_per_node": 8, "memory_gib": 79}]})
    assert held_back.groups[0].memory_bytes == 79 * GiB and not same_hardware(held_back, short)
    mixed = load_cluster(str(Path(__file__).parents[1] / "configs/clusters/mixed-h100-a100.yaml"))
    assert mixed.group("h100").memory_bytes == get_device("H100").memory_bytes  # it writes 80
    assert get_device("L4").memory_from_gib(24) == get_device("L4").memory_bytes
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "79.65 GiB (80 GB)" in out and "80 GiB" not in out.replace("A100-80GB", "")


# ---- profiling: a full disk, out of memory ----------------------------------------------------
PROFILE = ["profile", "--device", "cpu", "--model", "tiny-llama", "--micro-batches", "1,2", "--tp", "1",
           "--repeats", "1", "--warmup", "0"]


def test_profile_to_a_full_disk_is_one_line(capsys):
    assert main([*PROFILE, "-o", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "partita: error: no space left on device writing /dev/full", err


@pytest.mark.parametrize("failing, allocator", [(1, "cpu"), (1, "cuda"), (2, "cpu")])
def test_profile_out_of_memory(failing, allocator, tmp_path, monkeypatch, capsys):
    """The CPU allocator's error (a RuntimeError) and CUDA's OutOfMemoryError alike: at the
    smallest micro-batch nothing of the layer fits, so the command stops with one line naming
    the shape and writes no profile; at a larger one that point and the larger are left out (the
    planner extrapolates), as before."""
    import torch

    from partita.profiler import layers

    real = layers.measure_point

    def measure(spec, layer, shard, micro_batch, opts, clock):
        if micro_batch >= failing and shard.role == "block":
            if allocator == "cpu":
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 256000000000 bytes. Error code 12")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 238.42 GiB")
        return real(spec, layer, shard, micro_batch, opts, clock)

    monkeypatch.setattr(layers, "measure_point", measure)
    out = tmp_path / "profile.yaml"
    code = main([*PROFILE, "-o", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if failing == 1:
        assert code == 2 and not out.exists()
        assert len(err.strip().splitlines()) == 1, err
        assert "out of memory measuring block tp=1 at micro-batch 1 and sequence" in err and "--seq-len" in err
    else:
        assert code == 0
        blocks = [c for c in yaml.safe_load(out.read_text())["layers"] if c["kind"]["role"] == "block"]
        assert {c["micro_batch"] for c in blocks} == {1}


def test_metrics_to_a_full_disk_is_one_line_per_rank_not_a_traceback():
    """What each rank meets when --metrics fills the disk: a PartitaError line (the worker logs
    it and exits 2), not an OSError traceback."""
    pytest.importorskip("torch")
    from partita.runtime.metrics import MetricsWriter

    writer = MetricsWriter("/dev/full")
    try:
        with pytest.raises(PartitaError, match="^no space left on device writing --metrics /dev/full$"):
            writer.write({"step": 1})
    finally:
        writer.close()
