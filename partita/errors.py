"""The two ways Partita refuses: bad input (exit 2) and no plan fits (exit 3).

Both carry a message meant for a person: one line that names the problem and says
what to change. The CLI prints it and exits; nothing else catches these.
"""


class PartitaError(Exception):
    """Bad input: a spec, file, flag or plan the user must change. Exit code 2."""

    exit_code = 2


class InfeasibleError(PartitaError):
    """The input is well formed, but no plan in the search space fits. Exit code 3."""

    exit_code = 3
