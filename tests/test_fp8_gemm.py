"""benchmarks/fp8_gemm.py: the dry run on the CPU times the dense products and says why FP8 is not
measured, whole; on a GPU with FP8 tensor cores (``benchmarks/gpu_session.sh``) it measures both
and the share ratio the time model takes from a published H100 pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp8_gemm  # noqa: E402

torch = pytest.importorskip("torch")


def test_the_dry_run_times_the_dense_products_and_says_why_not_fp8(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert fp8_gemm.main(["--device", "cpu", "--shapes", "64x64x64,128x64x32", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["shape"] for r in data["rows"]] == [[64, 64, 64], [128, 64, 32]]
    assert all(r["dense_tflops"] > 0 and r["fp8_tflops"] is None for r in data["rows"])
    assert data["fp8_unavailable"] == "FP8 products need a CUDA device"
    assert data["median_fp8_share_over_bf16"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["fp8.json"]  # no temporary left behind
    assert "FP8 not measured" in capsys.readouterr().out


def test_the_share_is_each_rate_over_its_peak():
    result = {"rows": [{"shape": [16, 16, 16], "dense_tflops": 794.5, "fp8_tflops": 1402.6}]}
    shared = fp8_gemm.with_shares(result, 989, 1979)
    assert shared["median_fp8_share_over_bf16"] == pytest.approx((1402.6 / 1979) / (794.5 / 989))
    assert fp8_gemm.catalog_peaks("NVIDIA H100 80GB HBM3") == (989, 1979)
    assert fp8_gemm.catalog_peaks("NVIDIA H100 PCIe") == (756, 1513)
    assert fp8_gemm.catalog_peaks("NVIDIA A100-SXM4-80GB") == (312, None)


@pytest.mark.parametrize("argv", [["--shapes", "8x16x16"], ["--shapes", "100x100"], ["--device", "tpu"]])
def test_bad_arguments_are_one_usage_error(argv):
    with pytest.raises(SystemExit) as exit_:
        fp8_gemm.main(["--device", "cpu", *argv] if argv[0] != "--device" else argv)
    assert exit_.value.code == 2


@pytest.mark.skipif(not torch.cuda.is_available() or fp8_gemm.fp8_unavailable(torch, "cuda") != "",
                    reason="needs a CUDA device with FP8 tensor cores")
def test_fp8_products_run_faster_than_bf16_on_this_gpu():
    """The measured ratio on a Hopper part: FP8 faster than bf16, at a share of its peak near the
    published pairs' (0.88-0.93); a wide band, for the shape and the card's clocks."""
    data = fp8_gemm.with_shares(fp8_gemm.measure("cuda", ((8192, 8192, 8192),)),
                                *fp8_gemm.catalog_peaks(torch.cuda.get_device_name(0)))
    row = data["rows"][0]
    assert row["fp8_tflops"] > row["dense_tflops"]
    if data["median_fp8_share_over_bf16"] is not None:
        assert 0.6 < data["median_fp8_share_over_bf16"] < 1.2
