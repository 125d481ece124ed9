"""``python -m partita.profiler ...``: the same as ``partita profile ...``.

    python -m partita.profiler --model tiny-llama --device cpu --micro-batches 1,16 -o prof.yaml
"""

from __future__ import annotations

import argparse
import logging
import sys

from partita.errors import PartitaError
from partita.profiler.cli import add_profile_arguments, profile_command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m partita.profiler", description="measure layer and collective costs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and details")
    add_profile_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = ["python", "-m", "partita.profiler", *argv]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return profile_command(args)
    except PartitaError as e:
        print(f"partita: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
