"""``partita export-weights CHECKPOINT_DIR -o HF_DIR``: a run's checkpoint as a Hugging Face folder.

The newest intact step of the checkpoint directory (or ``--step N``) is read whole on this
machine (``torch.distributed.checkpoint``'s ``dcp_to_torch_save``: the shards of every rank,
whatever plan wrote them), its model's parameters renamed and laid out as the model family's
Hugging Face checkpoints are (``runtime/hf_weights.py``), and written as ``config.json`` and
``model.safetensors``, each whole, into a new folder that ``transformers`` loads and that
``partita launch --init-from`` reads back. The model is the checkpoint record's built-in model,
or ``--model`` (checked against the record's fingerprint).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from partita.errors import PartitaError


def add_export_weights_arguments(sub) -> None:
    p = sub.add_parser("export-weights", help="write a checkpoint's weights as a Hugging Face model folder")
    p.add_argument("checkpoint", help="a --checkpoint-dir of partita launch")
    p.add_argument("-o", "--output", required=True, help="the folder to write (new, or empty)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the newest intact one)")
    p.add_argument("--model", default=None,
                   help="the model (built-in name, YAML or config.json), where the checkpoint's is not built in")


def export_weights_command(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from partita.model import BUILTIN
    from partita.model_io import load_model
    from partita.runtime import checkpoint
    from partita.runtime.hf_weights import save_folder

    root = Path(args.checkpoint)
    if not root.is_dir():
        raise PartitaError(f"{root}: no such checkpoint directory")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PartitaError(f"-o {out}: exists and is not an empty folder; give a new one (nothing is overwritten)")
    step = args.step if args.step is not None else checkpoint.intact_step(root)[0]
    if step is None or not (checkpoint.step_dir(root, step) / ".metadata").is_file():
        raise PartitaError(f"{root}: no complete checkpoint{'' if args.step is None else f' at step {args.step}'}")
    record = checkpoint.read_record(root, step)
    if args.model is not None:
        spec = load_model(args.model)
    elif record is not None and record.model_name in BUILTIN:
        spec = BUILTIN[record.model_name]
    else:
        raise PartitaError(f"{root}: its model {record.model_name if record else '(unrecorded)'!r} is not built in; "
                           f"name it with --model")
    if record is not None and spec.fingerprint != record.model_fingerprint:
        raise PartitaError(f"{root}: the checkpoint holds model {record.model_name!r} ({record.model_fingerprint}), "
                           f"--model is {spec.name!r} ({spec.fingerprint}); give the checkpoint's model")
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(checkpoint.step_dir(root, step)), str(whole))
        state = torch.load(whole, map_location="cpu", weights_only=True)
    model = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in state["model"].items()}
    folder = save_folder(model, spec, out)
    print(f"wrote {folder}: {spec.name} at step {step} ({sum(v.numel() for v in model.values()):,} parameters) as a "
          f"Hugging Face folder (config.json, model.safetensors)")
    return 0
