"""The ``torchrefit`` command line: ``demo``, ``bench``, ``plan`` and ``native``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrefit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo
    demo.add_parser(sub)
    for name in ("bench", "plan", "native"):
        try:
            module = __import__(f"torchrefit.cli.{name}", fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
