"""``--json``: what `plan`, `check`, `show`, `models` and `devices` print for programs.

One JSON object on stdout and nothing else there (warnings and errors stay one line on stderr;
an error prints no JSON). Every object carries ``schema_version`` and ``command``; the schema is
``docs/json-schema.json`` and a test validates every command's output against it. Numbers are
in base units: seconds, bytes, tokens, US dollars.

    partita plan --model llama-3-8b --cluster 8xH100 --json | jq .plan.prediction.step_time_s
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from partita.devices import CATALOG, PRICE_SOURCE
from partita.model import BUILTIN
from partita.plan import Plan
from partita.cli.pricing import TrainingCost

SCHEMA_VERSION = 2  # 2: the plan object nests its degrees in "mesh"


def emit(obj: dict[str, Any]) -> None:
    """Write one JSON object (and a newline) to stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def _head(command: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "command": command}


def plan_summary(p: Plan) -> dict[str, Any]:
    """The shape of a plan in one line's worth of keys, for tables of alternatives."""
    pred = p.prediction
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch": p.micro_batch,
            "num_micro_batches": p.num_micro_batches, "world_size": p.world_size,
            "groups": ["+".join(s.groups) for s in p.stages],
            "blocks_per_stage": [sum(1 for l in s.layers if l.name.startswith("layers.")) for s in p.stages],
            "step_time_s": pred.step_time_s if pred else None, "tokens_per_s": pred.tokens_per_s if pred else None,
            "mfu": pred.mfu if pred else None,
            "peak_fraction": max(m.peak_bytes / m.capacity_bytes for m in pred.memory) if pred else None}


def plan_output(p: Plan, *, output: str, notes: Sequence[str], cost: TrainingCost | None,
                alternatives: Sequence[tuple[str, Plan, str, TrainingCost | None]] = ()) -> dict[str, Any]:
    """``alternatives``: (file, plan, search status, training cost or None) of each other shape."""
    out = _head("plan") | {"output": output, "plan": p.to_dict(), "notes": list(notes)}
    if cost is not None:
        out["training"] = cost.to_dict()
    if alternatives:
        out["alternatives"] = [{"rank": i + 1, "output": path, "status": status} | plan_summary(alt)
                               | ({"training": c.to_dict()} if c is not None else {})
                               for i, (path, alt, status, c) in enumerate(alternatives)]
    return out


def show_output(p: Plan, *, path: str, notes: Sequence[str], cost: TrainingCost | None) -> dict[str, Any]:
    out = _head("show") | {"path": path, "plan": p.to_dict(), "notes": list(notes)}
    if cost is not None:
        out["training"] = cost.to_dict()
    return out


def check_output(*, path: str, model: str, cluster: str, step_time_s: float,
                 stages: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """``stages``: (peak bytes, capacity bytes) per stage."""
    return _head("check") | {
        "path": path, "valid": True, "model": model, "cluster": cluster, "step_time_s": step_time_s,
        "fits": all(peak <= cap for peak, cap in stages),
        "stages": [{"stage": i, "peak_bytes": peak, "capacity_bytes": cap} for i, (peak, cap) in enumerate(stages)]}


def models_output() -> dict[str, Any]:
    return _head("models") | {"models": [
        {"name": m.name, "family": m.family, "params": m.n_params, "layers": m.n_layers, "hidden": m.hidden,
         "heads": m.heads, "kv_heads": m.kv_heads, "ffn": m.ffn, "vocab": m.vocab, "seq_len": m.seq_len}
        | ({"active_params": m.n_active_params, "experts": m.experts, "experts_per_token": m.experts_per_token}
           if m.is_moe else {})
        for m in BUILTIN.values()]}


def devices_output() -> dict[str, Any]:
    return _head("devices") | {"price_source": PRICE_SOURCE, "devices": [
        {"name": d.name, "memory_bytes": d.memory_bytes, "bf16_tflops": d.bf16_tflops,
         "fp16_tflops": d.fp16_tflops, "fp32_tflops": d.fp32_tflops, "fp8_tflops": d.fp8_tflops,
         "hbm_gbps": d.hbm_gbps,
         "intra_link": d.intra_link, "intra_node_gbps": d.intra_node_gbps, "network_gbps": d.network_gbps,
         "gpus_per_node": d.gpus_per_node, "price_per_gpu_hour": d.price_per_gpu_hour, "source": d.source}
        for d in CATALOG.values()]}
