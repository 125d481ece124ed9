"""The command line as a user runs it: exit codes, one-line errors, files written."""

import subprocess
import sys

import yaml

from partita.cli import main
from torch_blocker import BLOCK_TORCH  # noqa: E402


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "partita.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_plan_tiny_on_cpu_writes_a_valid_plan(tmp_path):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "-o", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    assert data["schema_version"] == 2 and data["dtype"] == "fp32"
    assert main(["check", str(out), "--cluster", "4xcpu"]) == 0
    assert main(["show", str(out)]) == 0
    # a different cluster is refused
    assert main(["check", str(out), "--cluster", "8xcpu"]) == 2


def test_bad_input_is_one_line_and_exit_2():
    for args, needle in [
        (["plan", "--model", "llama-2-7c", "--cluster", "8xH100"], "did you mean"),
        (["plan", "--model", "llama-2-7b", "--cluster", "8xH1000"], "unknown device"),
        (["plan", "--model", "llama-2-7b", "--cluster", "0x8xH100"], ">= 1"),
        (["plan", "--model", "llama-2-7b", "--cluster", "8xH100", "--global-batch", "-4"], "must be >= 1"),
        (["show", "/nonexistent/plan.yaml"], "no such file"),
        (["plan", "--model", "llama-2-7b", "--cluster", "8xH100", "--tp", "3"], "not divisible"),
        (["plan", "--model", "llama-2-7b", "--cluster", "8xH100", "--zero", "4"], "ZeRO levels"),
    ]:
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\nfamily: llama\nhidden: [1, 2\n")
    r = run("plan", "--model", str(bad), "--cluster", "8xH100")
    assert r.returncode == 2 and f"{bad}:" in r.stderr and "malformed YAML" in r.stderr


def test_model_that_cannot_fit_exits_3():
    r = run("plan", "--model", "gpt3-175b", "--cluster", "1x8xL4")
    assert r.returncode == 3
    assert "least memory per device" in r.stderr and "Traceback" not in r.stderr


def test_models_and_devices_list():
    r = run("models")
    assert r.returncode == 0 and "llama-3-405b" in r.stdout
    r = run("devices")
    assert r.returncode == 0 and "MI300X" in r.stdout


def test_search_imports_without_torch(tmp_path):
    code = (BLOCK_TORCH +
            "import partita, partita.cli, partita.cli.plan, partita.validate\n"
            "import partita.search.costs.model, partita.search.cpsat, partita.search.uniform, partita.search.planner\n"
            "from partita.cli import main\n"
            "sys.exit(main(['plan', '--model', 'gpt2', '--cluster', '8xA100-80GB', '-o', sys.argv[1]]))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_plan_flags_pin_the_space(tmp_path):
    out = tmp_path / "p.yaml"
    assert main(["plan", "--model", "llama-2-7b", "--cluster", "2x8xH100", "--tp", "8", "--pp", "2",
                 "--zero", "1", "--no-recompute", "-o", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    assert (data["mesh"]["tp"], data["mesh"]["pp"]) == (8, 2)
    layers = [l for s in data["stages"] for l in s["layers"]]
    assert all(l["recompute"] == "none" for l in layers)
    assert all(l["zero"] == 1 for l in layers) or data["mesh"]["dp"] == 1


def test_recompute_modes_are_searched_and_shown(tmp_path, capsys):
    """Where memory binds, blocks recompute selectively (the products' outputs kept), and the
    summary says so; --recompute limits the modes, and --no-recompute cannot disagree with it."""
    out = tmp_path / "p.yaml"
    assert main(["plan", "--model", "llama-2-13b", "--cluster", "1x8xA100-40GB", "--seq-len", "8192",
                 "--recompute", "none,selective", "-o", str(out)]) == 0
    assert "selective recompute" in capsys.readouterr().out
    modes = [l["recompute"] for s in yaml.safe_load(out.read_text())["stages"] for l in s["layers"]]
    assert set(modes) <= {"none", "selective"} and "selective" in modes
    assert main(["plan", "--model", "tiny-llama", "--cluster", "2xcpu", "--no-recompute", "--recompute", "selective",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--no-recompute and --recompute selective disagree" in err
    r = run("plan", "--model", "tiny-llama", "--cluster", "2xcpu", "--recompute", "partial", "-o", str(out))
    assert r.returncode == 2 and "expected some of none,selective,full" in r.stderr


def test_check_refuses_a_hand_edited_tp_that_does_not_divide(tmp_path):
    out = tmp_path / "p.yaml"
    assert main(["plan", "--model", "tiny-llama", "--cluster", "4xcpu", "--search", "uniform", "--pp", "1", "-o", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    data["mesh"]["dp"], data["mesh"]["tp"] = 1, 3
    data["global_batch"] = data["micro_batch"] * data["num_micro_batches"]
    for stage in data["stages"]:
        stage["ranks"] = [0, 1, 2][:3]
        for layer in stage["layers"]:
            layer["tensor_parallel"], layer["zero"] = 3, 0
    out.write_text(yaml.safe_dump(data))
    r = run("check", str(out), "--cluster", "4xcpu")
    assert r.returncode == 2 and "not divisible by tensor-parallel degree 3" in r.stderr
