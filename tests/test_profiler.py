"""The profiler on the CPU: tiny models, every field, times, activation memory, bad input.

Tolerances: activation memory is counted exactly (autograd's saved tensors), so it must agree
with the count derived from the runtime's tensor shapes within 2%, and with
``search.analytic.activation_bytes`` within 10%. Times are only required to be positive and to
grow from micro-batch 1 to 16 (16x the tokens) for the block and the head, which a noisy shared
2-core machine does not upset; the embedding's lookup is too small to time reliably.
"""

import datetime
import os

import pytest

torch = pytest.importorskip("torch")

from partita.cli import main as partita_main  # noqa: E402
from partita.model_io import load_model  # noqa: E402
from partita.profile import Profile  # noqa: E402
from partita.cli.profile import main as profiler_main  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
FAST = ["--device", "cpu", "--warmup", "1", "--repeats", "5", "--threads", "1"]


@pytest.fixture(scope="session")
def tiny_llama_profile(tmp_path_factory) -> tuple[Profile, str]:
    """tiny-llama at micro-batches 1 and 16, TP widths 1 and 2, with 2-rank gloo collectives."""
    out = tmp_path_factory.mktemp("prof") / "tiny-llama.yaml"
    rc = partita_main(["profile", "--model", "tiny-llama", "--micro-batches", "1,16", "--tp", "1,2", *FAST,
                       "--comm", "--nproc", "2", "--comm-sizes", "16KiB:4MiB", "-o", str(out)])
    assert rc == 0
    return Profile.load(out), str(out)


@pytest.fixture(scope="session")
def tiny_gpt2_profile(tmp_path_factory) -> Profile:
    out = tmp_path_factory.mktemp("prof") / "tiny-gpt2.yaml"
    assert profiler_main(["--model", "tiny-gpt2", "--micro-batches", "1,4", "--tp", "1,4", *FAST, "-o", str(out)]) == 0
    return Profile.load(out)


def test_every_kind_width_and_micro_batch_is_measured(tiny_llama_profile):
    prof, _ = tiny_llama_profile
    spec = load_model("tiny-llama")
    assert prof.device == "cpu" and prof.dtype == "fp32"
    keys = {(c.kind.role, c.tp, c.micro_batch) for c in prof.layers}
    assert keys == {(r, tp, mb) for r in ("embed", "block", "head") for tp in (1, 2) for mb in (1, 16)}
    for c in prof.layers:
        assert c.kind == spec.kinds[c.kind.role]
        assert c.seq_len == spec.seq_len
        assert c.forward_s > 0 and c.backward_s > 0 and c.recompute_s > 0
        assert c.activation_bytes > 0
        # a block's selective recomputation too (None where timing noise swallowed it); the others have none
        if c.kind.role != "block":
            assert c.selective_recompute_s is None
    assert any(c.selective_recompute_s for c in prof.layers if c.kind.role == "block")


def test_parameter_bytes_are_the_shards(tiny_llama_profile):
    prof, _ = tiny_llama_profile
    spec = load_model("tiny-llama")
    by = {(c.kind.role, c.tp): c.param_bytes for c in prof.layers}
    for role in ("embed", "block", "head"):
        assert by[(role, 1)] == 4 * spec.kinds[role].params  # fp32
    h = spec.hidden
    assert by[("embed", 2)] == 4 * spec.vocab * h // 2
    assert by[("head", 2)] == 4 * (spec.vocab * h // 2 + h)  # the final norm is not sharded
    assert by[("block", 2)] == 4 * (spec.kinds["block"].matmul_params // 2 + 2 * h)


def test_provenance(tiny_llama_profile):
    prof, path = tiny_llama_profile
    p = prof.provenance
    assert p.source == "measured"
    assert p.device_name and p.host
    assert p.torch == torch.__version__
    assert p.dtype == "fp32"
    assert datetime.datetime.fromisoformat(p.date).tzinfo is not None
    assert p.command.startswith("partita profile") and "--model tiny-llama" in p.command and path in p.command


def test_times_grow_with_micro_batch(tiny_llama_profile):
    prof, _ = tiny_llama_profile
    t = {(c.kind.role, c.tp, c.micro_batch): c.forward_s + c.backward_s for c in prof.layers}
    for role in ("block", "head"):
        for tp in (1, 2):
            assert t[(role, tp, 16)] > t[(role, tp, 1)], (role, tp, t[(role, tp, 1)], t[(role, tp, 16)])


def llama_block_saved_bytes(spec, *, tp: int, b: int, s: int) -> int:
    """What the runtime's llama block keeps for backward on the CPU in fp32, tensor by tensor."""
    e, h, d = 4, spec.hidden, spec.head_dim
    heads, f, t = spec.heads // tp, spec.ffn // tp, b * s
    norm = [t * h * e, t * 4, t * h * e, t * h * e]  # input, rstd, x*rstd, *weight (the linears' input)
    rotary = [s * d * e] * 4  # cos and sin tables, for q and for k
    attention = [t * heads * d * e] * 4 + [b * heads * s * 4]  # q, repeated k and v, output; logsumexp
    mlp = [t * f * e] * 4  # w1 out, silu out, w3 out, the product
    return sum(norm * 2 + rotary + attention + mlp)


def llama_head_saved_bytes(spec, *, tp: int, b: int, s: int) -> int:
    e, h, t, vocab = 4, spec.hidden, b * s, spec.vocab // tp
    norm = [t * h * e, t * 4, t * h * e, t * h * e]
    loss = [t * vocab * 4, t * 8, 4]  # log_softmax output (fp32), int64 targets, total weight
    return sum(norm + loss)


def test_activation_memory_matches_the_tensor_shapes(tiny_llama_profile):
    prof, _ = tiny_llama_profile
    spec = load_model("tiny-llama")
    for c in prof.layers:
        kw = dict(tp=c.tp, b=c.micro_batch, s=c.seq_len)
        expected = {"embed": 8 * c.micro_batch * c.seq_len,  # int64 token ids
                    "block": llama_block_saved_bytes(spec, **kw), "head": llama_head_saved_bytes(spec, **kw)}[c.kind.role]
        assert c.activation_bytes == pytest.approx(expected, rel=0.02), (c.kind.role, c.tp, c.micro_batch)


def test_activation_memory_matches_the_analytic_model(tiny_llama_profile, tiny_gpt2_profile):
    analytic = pytest.importorskip("partita.search.analytic")
    for prof in (tiny_llama_profile[0], tiny_gpt2_profile):
        for c in prof.layers:
            a = analytic.activation_bytes(c.kind, tp=c.tp, micro_batch=c.micro_batch, seq_len=c.seq_len,
                                          dtype="fp32", sequence_parallel=False, recompute="none", on_cpu=True)
            assert c.activation_bytes == pytest.approx(a, rel=0.10), (c.kind.family, c.kind.role, c.tp, c.micro_batch)


def test_comm_section_is_written(tiny_llama_profile):
    prof, _ = tiny_llama_profile
    # Which ops get a fit depends on timing: on a loaded machine one op's times may come out flat
    # over the sizes, and its fit is then left out with a warning (profiler.comm.fit_comm; the
    # fitting itself, and the flat case, are tested on recorded samples in test_profiler_comm.py). What is written is
    # always one 2-rank loopback entry per op, in the ops' order.
    ops = [(c.op, c.link, c.ranks) for c in prof.comm]
    expected = [(op, "loopback", 2) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")]
    assert ops and ops == [k for k in expected if k in ops]
    for c in prof.comm:
        assert c.latency_s >= 0 and c.bandwidth_gbps > 0


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("partita: error:")
    return err[0]


@pytest.mark.parametrize("argv, says", [
    (["--model", "tiny-llama", "--device", "tpu"], "unknown --device 'tpu'"),
    (["--model", "tiny-llama", "--device", "cpu", "--tp", "3"], "--tp 3 does not divide"),
    (["--model", "tiny-llama", "--device", "cpu", "--micro-batches", "1,x"], "--micro-batches"),
    (["--model", "tiny-llama", "--device", "cpu", "--micro-batches", "0"], "--micro-batches"),
    (["--model", "no-such-model", "--device", "cpu"], "unknown model"),
    (["--device", "cpu"], "--model is required"),
    (["--comm-only", "--device", "cpu", "--comm-sizes", "4KiB"], "--comm-sizes"),
    (["--comm-only", "--device", "cpu", "--nproc", "1"], "at least 2 ranks"),
    (["--model", "tiny-gpt2", "--device", "cpu", "--seq-len", "65"], "position"),
    (["--model", "tiny-llama", "--device", "cpu", "--device-type", "TPUv9"], "unknown device"),
    (["--model", "tiny-llama", "--device", "cpu", "--repeats", "0"], "--repeats"),
])
def test_bad_input_is_one_line_exit_2(argv, says, capsys, tmp_path):
    assert partita_main(["profile", *argv, "-o", str(tmp_path / "p.yaml")]) == 2
    assert says in one_error_line(capsys)
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_exit_2(capsys, tmp_path):
    assert profiler_main(["--model", "tiny-llama", "--device", "cuda", "-o", str(tmp_path / "p.yaml")]) == 2
    assert "no CUDA GPU" in one_error_line(capsys)


def test_width_that_misses_only_the_vocabulary_skips_embed_and_head():
    from partita.profiler.layers import LayerOptions, plan_shards

    spec = load_model("gpt2")  # vocab 50257 divides by nothing; heads 12 divide by 2
    shards, notes = plan_shards(spec, LayerOptions(device=torch.device("cpu"), dtype="fp32", seq_len=64,
                                                   micro_batches=(1,), tps=(1, 2)))
    assert {(s.role, s.tp) for s in shards} == {("embed", 1), ("block", 1), ("head", 1), ("block", 2)}
    assert len(notes) == 2 and all("vocab 50257" in n for n in notes)


def test_a_plan_from_the_measured_profile_validates(tiny_llama_profile, tmp_path, capsys):
    from partita.plan import Plan

    prof, path = tiny_llama_profile
    plan_path = tmp_path / "plan.yaml"
    rc = partita_main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--profile", path,
                       "--time-limit", "5", "-o", str(plan_path)])
    assert rc == 0, capsys.readouterr().err
    plan = Plan.load(plan_path)
    assert plan.cost_sources == {"cpu": "measured"}
    assert plan.profile_fingerprint == prof.fingerprint
    assert partita_main(["check", str(plan_path), "--cluster", "4xcpu", "--profile", path]) == 0


def test_missing_output_directory_is_one_line_exit_2(capsys, tmp_path):
    out = tmp_path / "no" / "p.yaml"
    assert partita_main(["profile", "--model", "tiny-llama", "--device", "cpu", "-o", str(out)]) == 2
    assert "no such directory" in one_error_line(capsys)


def test_the_host_time_per_op_is_measured_and_floors_analytic_layers(tiny_llama_profile):
    """`partita profile` measures the host's time per eager op on the device; a cost model with
    the profile puts it under the layers the profile did not measure, and a profile without it
    (older, or --comm-only) keeps its file and fingerprint as they were."""
    import dataclasses

    from partita.cluster import parse_short
    from partita.model_io import load_model
    from partita.search.costs.model import CostModel
    from partita.search.timing import default_constants

    profile, path = tiny_llama_profile
    assert profile.op_overhead_s is not None and 1e-7 < profile.op_overhead_s < 1e-3
    assert Profile.load(path).op_overhead_s == profile.op_overhead_s
    # Another model on the same device: every layer analytic, floored by the measured overhead.
    cm = CostModel(load_model("tiny-gpt2"), parse_short("2xcpu"), seq_len=64, dtype=profile.dtype,
                   profiles=(profile,))
    assert cm.time_constants("cpu").op_overhead_s == profile.op_overhead_s
    plain = CostModel(load_model("tiny-gpt2"), parse_short("2xcpu"), seq_len=64, dtype=profile.dtype)
    assert plain.time_constants("cpu") == default_constants(on_cpu=True)
    older = dataclasses.replace(profile, op_overhead_s=None)
    assert "op_overhead_s" not in older.to_dict()
    assert Profile.from_dict(older.to_dict()).fingerprint == older.fingerprint
