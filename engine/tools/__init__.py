"""Scale tools: dry run, memory estimate, planner, SLURM templates, sweeps, HF conversion."""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse with Tessera's error contract: a bad flag is one ``error:`` line on stderr and exit status 2
    (argparse's own usage block above its ``prog: error:`` line is left out; ``--help`` shows the usage)."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)
