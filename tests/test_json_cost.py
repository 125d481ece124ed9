"""--json on plan/check/show/models/devices (validated against docs/json-schema.json), --tokens
(time, GPU-hours, dollars per device type, prices overridable in the cluster YAML), plan --top K."""

import json
from pathlib import Path

import pytest
import yaml

from partita.cli import main
from partita.cluster import load_cluster
from partita.errors import PartitaError
from partita.plan import Plan
from partita.cli.pricing import parse_tokens, training_cost
from torch_blocker import BLOCK_TORCH  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "json-schema.json").read_text())
MIXED = "2x8xH100+2x8xA100-80GB"


def run_json(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    obj = json.loads(out)  # the whole of stdout is one JSON object
    jsonschema.validate(obj, SCHEMA)
    return obj


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "plan.yaml"
    assert main(["plan", "--model", "llama-3-8b", "--cluster", MIXED, "--global-batch", "64", "-o", str(path)]) == 0
    return path


def test_every_command_prints_schema_valid_json(capsys, tmp_path, mixed_plan):
    out = run_json(capsys, ["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "-o", str(tmp_path / "t.yaml"),
                            "--json"])
    assert out["command"] == "plan" and out["plan"] == Plan.load(tmp_path / "t.yaml").to_dict()
    assert run_json(capsys, ["show", str(mixed_plan), "--json", "--tokens", "1T"])["training"]["tokens"] == 10**12
    check = run_json(capsys, ["check", str(mixed_plan), "--cluster", MIXED, "--json"])
    assert check["fits"] and len(check["stages"]) == Plan.load(mixed_plan).pp
    assert any(m["name"] == "llama-3-8b" for m in run_json(capsys, ["models", "--json"])["models"])
    devices = run_json(capsys, ["devices", "--json"])["devices"]
    assert {d["name"]: d["price_per_gpu_hour"] for d in devices}["H100"] > 0


def test_schema_refuses_what_is_not_output():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"schema_version": 2, "command": "check", "valid": True}, SCHEMA)


@pytest.mark.parametrize("text,tokens", [("2T", 2 * 10**12), ("500B", 5 * 10**11), ("1e12", 10**12),
                                         ("1.5t", 15 * 10**11), ("300M", 3 * 10**8), ("4096", 4096)])
def test_token_counts(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "two", "-1T", "0", "2X", "1e30"])
def test_bad_token_counts(text):
    with pytest.raises(PartitaError, match="--tokens"):
        parse_tokens(text)


def test_time_gpu_hours_and_cost_per_device_type(mixed_plan):
    p = Plan.load(mixed_plan)
    cost = training_cost(p, load_cluster(MIXED), 10**12)
    assert cost.seconds == pytest.approx(10**12 / p.prediction.tokens_per_s)
    by = {d.device: d for d in cost.by_device}
    for device, price in (("H100", 3.0), ("A100-80GB", 1.3)):
        ranks = sum(len(s.ranks) for s in p.stages if s.device == device)
        if ranks:
            assert by[device].gpu_hours == pytest.approx(ranks * cost.seconds / 3600)
            assert by[device].cost_usd == pytest.approx(by[device].gpu_hours * price)
    assert cost.cost_usd == pytest.approx(sum(d.cost_usd for d in cost.by_device))


def test_cluster_yaml_overrides_prices_without_changing_the_cluster(tmp_path, mixed_plan, capsys):
    spec = load_cluster(MIXED).to_dict()
    for g in spec["groups"]:
        g["price_per_gpu_hour"] = 2.0 if g["device"] == "H100" else 0.5
    path = tmp_path / "priced.yaml"
    path.write_text(yaml.safe_dump(spec))
    priced = load_cluster(str(path))
    assert priced.fingerprint == load_cluster(MIXED).fingerprint  # a price is not hardware
    p = Plan.load(mixed_plan)
    cost = training_cost(p, priced, 10**12)
    assert {d.device: d.price_per_gpu_hour for d in cost.by_device}.items() <= {"H100": 2.0, "A100-80GB": 0.5}.items()
    out = run_json(capsys, ["plan", "--model", "llama-3-8b", "--cluster", str(path), "--global-batch", "64",
                            "--tokens", "2T", "-o", str(tmp_path / "p.yaml"), "--json"])
    assert out["training"]["cost_usd"] == pytest.approx(sum(d["gpu_hours"] * {"H100": 2.0, "A100-80GB": 0.5}[d["device"]]
                                                            for d in out["training"]["by_device"]))


def test_unpriced_devices_report_hours_and_no_dollars(tmp_path, capsys):
    path = tmp_path / "l4.yaml"
    assert main(["plan", "--model", "gpt2", "--cluster", "8xL4", "-o", str(path), "--tokens", "1B"]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "no price" in out


def test_top_k_lists_different_shapes_best_first(tmp_path, capsys):
    base = ["plan", "--model", "llama-3-8b", "--cluster", MIXED, "--global-batch", "64"]
    assert main([*base, "-o", str(tmp_path / "one.yaml")]) == 0
    capsys.readouterr()
    out = run_json(capsys, [*base, "-o", str(tmp_path / "p.yaml"), "--top", "3", "--json", "--tokens", "1T"])
    one, best = Plan.load(tmp_path / "one.yaml"), Plan.load(tmp_path / "p.yaml")
    assert best.solver.objective_us == one.solver.objective_us  # K=1 is the ordinary, exact search
    alts = out["alternatives"]
    assert 1 <= len(alts) <= 2
    shapes = {(best.dp, best.tp, best.micro_batch, best.num_micro_batches)}
    times = [best.prediction.step_time_s]
    for alt in alts:
        p = Plan.load(alt["output"])
        shapes.add((p.dp, p.tp, p.micro_batch, p.num_micro_batches))
        times.append(p.prediction.step_time_s)
        assert alt["step_time_s"] == p.prediction.step_time_s
        assert alt["training"]["seconds"] == pytest.approx(10**12 / p.prediction.tokens_per_s)
    assert len(shapes) == 1 + len(alts) and times == sorted(times)
    assert main([*base, "-o", str(tmp_path / "q.yaml"), "--top", "2", "--tokens", "1T"]) == 0
    table = capsys.readouterr().out
    assert "the best plans of 2 shapes" in table and "GPU-hours" in table and (tmp_path / "q-2.yaml").is_file()


@pytest.mark.parametrize("argv,phrase", [
    (["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--tokens", "lots"], "--tokens"),
    (["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--top", "2", "--search", "uniform"], "--top 2"),
    (["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--top", "0"], "--top"),
])
def test_bad_flags_are_one_line(argv, phrase, tmp_path, capsys):
    assert main([*argv, "-o", str(tmp_path / "x.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and phrase in captured.err


def test_export_pricing_json_and_top_k_need_no_torch(tmp_path):
    """export, --tokens, --json and --top run where torch is not installed (a login node)."""
    import subprocess
    import sys

    code = (BLOCK_TORCH +
            "import partita.cli.export, partita.cli.export_megatron, partita.cli.export_torchtitan, partita.cli.export_deepspeed\n"
            "import partita.cli.pricing, partita.cli.jsonout, partita.cli.slurm, partita.search.topk\n"
            "from partita.cli import main\n"
            "plan = sys.argv[1]\n"
            "assert main(['plan', '--model', 'gpt2', '--cluster', '8xH100', '-o', plan, '--tokens', '1B', '--top', '2',"
            " '--json']) == 0\n"
            "sys.exit(main(['export', plan, '--to', 'megatron', '-o', plan + '.args']))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.yaml")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.yaml.args").is_file()


def test_cost_objective_picks_the_cheapest_plan_per_token_which_is_not_the_fastest():
    """--objective cost with idle devices released: on 4 H100s beside 4 A100s at their catalog
    prices, gpt2 runs fastest on the H100s and cheapest per token on fewer, cheaper devices. The
    frontier starts at the fastest plan, each next point is the fastest plan of strictly lower
    price, and the chosen plan is the frontier's cheapest; no plan of the A100 group alone (a
    sub-cluster the frontier must cover) is cheaper."""
    from partita.model_io import load_model
    from partita.search.cost_objective import cost_bound, make_cost_plan, plan_price, usd_per_million_tokens
    from partita.search.planner import PlanRequest, make_plan

    model = load_model("gpt2")
    from partita.cluster import parse_short

    cluster = parse_short("1x4xH100+1x4xA100-80GB")
    req = PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=32)
    plan, frontier = make_cost_plan(req)
    fastest, _ = make_plan(req)
    assert frontier[0].plan.prediction.step_time_s == fastest.prediction.step_time_s
    prices = [p.price_uph for p in frontier]
    assert prices == sorted(prices, reverse=True) and len(set(prices)) == len(prices)
    times = [p.plan.prediction.step_time_s for p in frontier]
    assert times == sorted(times)  # a lower price never buys a faster plan
    chosen = usd_per_million_tokens(plan, plan_price(plan, cluster))
    assert chosen == min(p.usd_per_mtok for p in frontier)
    # Every point is proven (replicas on both device types too, since search/replicas.py bounds its
    # space), and the walk reached its end: the cost bound is the chosen plan's cost.
    assert all(p.exact for p in frontier) and frontier[-1].stopped == "nothing cheaper fits"
    assert [p.stopped for p in frontier[:-1]] == [""] * (len(frontier) - 1)
    assert cost_bound(frontier, 1_300_000) == pytest.approx(chosen, rel=1e-4)
    assert chosen < usd_per_million_tokens(fastest, plan_price(fastest, cluster))
    assert plan_price(plan, cluster) < plan_price(fastest, cluster)
    a100 = parse_short("1x4xA100-80GB")
    alone, _ = make_plan(PlanRequest(model=model, cluster=a100, seq_len=model.seq_len, global_batch=32))
    assert chosen <= usd_per_million_tokens(alone, plan_price(alone, a100)) + 1e-12


def test_cost_objective_needs_a_price_for_every_group(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\ngroups:\n  - {name: a, device: A100-40GB, nodes: 1, gpus_per_node: 2}\n")
    for argv, phrase in ((["--cluster", str(spec), "--objective", "cost", "--release-idle"], "price_per_gpu_hour"),
                         (["--cluster", "4xcpu", "--release-idle"], "--objective cost")):
        assert main(["plan", "--model", "tiny-llama", *argv, "-o", str(tmp_path / "p.yaml")]) == 2
        captured = capsys.readouterr()
        assert len(captured.err.strip().splitlines()) == 1 and phrase in captured.err, captured.err


def test_the_cost_bound_covers_the_prices_the_walk_did_not_reach():
    """A plan priced between two frontier points costs at least the upper point's price at its
    proven step-time bound; where the walk ran out of time, one below the last point costs at
    least the cheapest device's price at the last point's bound."""
    from types import SimpleNamespace

    from partita.search.cost_objective import OUT_OF_TIME, FrontierPoint, cost_bound

    def point(price, bound_s, stopped="", floor=None):
        plan = SimpleNamespace(solver=SimpleNamespace(bound_us=int(bound_s * 1e6)), global_batch=1, seq_len=1_000_000)
        return FrontierPoint(plan=plan, price_uph=price, usd_per_mtok=0.0, exact=True, stopped=stopped,
                             floor_uph=floor)

    usd = 1 / 3600  # a step of 1 s on devices of $1/h, a million tokens a step: dollars per million tokens
    walked = [point(10_000_000, 1.0), point(4_000_000, 2.0, "nothing cheaper fits")]
    assert cost_bound(walked, 1_000_000) == pytest.approx(8 * usd)  # $4/h at 2 s, below $10/h at 1 s
    cut = [point(10_000_000, 1.0), point(4_000_000, 2.0, OUT_OF_TIME)]
    assert cost_bound(cut, 1_000_000) == pytest.approx(2 * usd)  # a $1/h device at 2 s or slower
    # A walk that stepped from $10/h down to $6/h: the first search speaks for the prices from $6/h.
    jumped = [point(10_000_000, 1.0, floor=6_000_000), point(4_000_000, 2.0, "nothing cheaper fits")]
    assert cost_bound(jumped, 1_000_000) == pytest.approx(6 * usd)


def test_cost_objective_with_dear_devices_finds_the_cheap_ones_first(tmp_path):
    """H100s at $500,000 an hour beside A100s at a cent: the walk searches the cheapest group's
    price first (``cost_objective._cheapest_group``) and steps over the dear prices, so the plan is
    on the A100s alone and proven, in a few searches (it walked down the H100 prices a stage at a
    time before, and a minute's limit ended on a $2,000,000/h plan)."""
    from partita.cluster import load_cluster
    from partita.model_io import load_model
    from partita.search.cost_objective import make_cost_plan, plan_price
    from partita.search.planner import PlanRequest

    spec = tmp_path / "c.yaml"
    spec.write_text("schema_version: 1\nname: dear\ngroups:\n"
                    "  - {name: h100, device: H100, nodes: 1, gpus_per_node: 4, price_per_gpu_hour: 500000}\n"
                    "  - {name: a100, device: A100-80GB, nodes: 1, gpus_per_node: 4, price_per_gpu_hour: 0.01}\n")
    cluster = load_cluster(str(spec))
    model = load_model("gpt2")
    plan, frontier = make_cost_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len, global_batch=32))
    assert {name for _, name in plan.rank_groups()} == {"a100"}
    assert plan_price(plan, cluster) <= 4 * 10_000
    assert all(p.exact for p in frontier) and len(frontier) <= 4
