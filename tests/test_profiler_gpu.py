"""The profiler on a GPU: skipped without one, never faked.

On a GPU, activation memory comes from the CUDA allocator; it must agree with autograd's
saved-tensor count within 10% (the allocator rounds blocks to 512 B and keeps SDPA's RNG state).
"""

import pytest

torch = pytest.importorskip("torch")

from partita.model_io import load_model  # noqa: E402
from partita.profiler.provenance import catalog_name_for_gpu  # noqa: E402


@pytest.mark.parametrize("driver_name, catalog", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("Tesla V100-SXM2-16GB", "V100-16GB"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"), ("AMD Instinct MI300X", "MI300X"), ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_names_map_to_the_catalog(driver_name, catalog):
    assert catalog_name_for_gpu(driver_name) == catalog


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_llama_on_the_gpu():
    from partita.profiler.layers import LayerOptions, profile_layers

    spec = load_model("tiny-llama")
    opts = LayerOptions(device=torch.device("cuda"), dtype="bf16", seq_len=64, micro_batches=(1, 16), tps=(1, 2),
                        warmup=2, repeats=5)
    points = list(profile_layers(spec, opts))
    assert len(points) == 12
    for m in points:
        c = m.cost
        assert c.forward_s > 0 and c.backward_s > 0 and c.recompute_s > 0
        assert m.allocator_bytes is not None and c.activation_bytes == m.allocator_bytes
        if m.role != "embed":  # int64 token ids: one 512 B allocator block vs 8 B/token
            assert m.allocator_bytes == pytest.approx(m.saved_bytes, rel=0.10), (m.role, c.tp, c.micro_batch)
