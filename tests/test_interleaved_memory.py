"""Interleaved 1F1B charges each in-flight (virtual stage, micro-batch) pair at its own virtual
stage's activations, moment by moment (``schedules.held_moments``)."""

from collections import Counter

from partita.cluster import parse_short
from partita.model import BUILTIN
from partita.search.costs.model import CostModel
from partita.search.costs.stage import choice_of
from partita.search.evaluate import evaluate_interleaved
from partita.search.interleaved import chunk_names
from partita.search.uniform import strategy
from partita.units import GiB


def test_llama3_405b_interleaved_last_stage_holds_its_logits_once():
    """Llama 3's own layout (tp 8 x pp 16, interleaved v = 4, full recomputation) on 16,384 H100:
    the last stage's activations are near the others' (it was 41 GiB when every pair was
    charged at the head's virtual stage), and the plan fits the 80 GB part."""
    model = BUILTIN["llama-3-405b"]
    cluster = parse_short("2048x8xH100")
    cm = CostModel(model, cluster, seq_len=8192)
    pp, v, tp, dp = 16, 4, 8, 128
    kinds = {n: choice_of(model, strategy(model, n, tp=tp, sp=True, zero=1, recompute="full"))
             for n in ("embed", "layers.0", "head")}
    counts = [[Counter(kinds["layers.0" if n.startswith("layers.") else n] for n in chunk) for chunk in stage]
              for stage in chunk_names(model.n_layers, pp, v)]
    ev = evaluate_interleaved(cm, [(cluster.groups[0], c) for c in counts], dp=dp, tp=tp, micro_batch=1,
                              num_micro_batches=2048 // dp)
    assert ev.fits
    acts = [s.activations for s in ev.stages]
    assert acts[-1] < 8 * GiB
    assert acts[-1] < 1.5 * max(acts[:-1])
