"""The ``hetero-plugins`` command: ``demo`` runs the main job, ``bench`` the benchmarks, ``simulate`` /
``pretrain`` / ``transfer`` the learned scheduler (issue 4)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hetero-plugins", description="Heterogeneity-aware data-parallel training.")
    parser.add_argument("command", choices=["demo", "bench", "simulate", "pretrain", "transfer"],
                        help="demo: stock DDP vs HeteroDDPStrategy; bench: benchmarks; simulate / pretrain / transfer: "
                        "the learned scheduler on the cluster simulator")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command in ("simulate", "pretrain", "transfer"):
        from hetero_plugins.scheduler import commands

        return getattr(commands, f"{args.command}_main")(argv[1:])
    if args.command == "demo":
        from hetero_plugins.apps.demo import main as demo_main

        return demo_main(argv[1:])
    from hetero_plugins.apps.bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
