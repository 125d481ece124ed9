"""The `partita` command: the app above the core (``partita``), the search and the runtime.

    partita plan --model llama-2-70b --cluster 8x8xH100 -o plan.yaml
    partita plan --model config.json --cluster 4x8xA100-80GB+2x8xH100 --profile h100.yaml
    partita check plan.yaml --cluster 8x8xH100
    partita show plan.yaml --tokens 2T
    partita show plan.yaml --timeline step.svg --report plan.html
    partita export plan.yaml --to megatron -o megatron.args
    partita launch plan.yaml --emit slurm -o job.sbatch
    partita models | partita devices
    partita launch plan.yaml --steps 20          (needs torch)
    partita profile --model tiny-llama --device cpu -o prof.yaml   (needs torch)
    partita calibrate runs/plan -o cpu-calibrated.yaml

Exit codes: 0 ok; 2 bad input (one line on stderr); 3 no plan fits (with the reason).
"""

from partita.cli.main import main

__all__ = ["main"]
