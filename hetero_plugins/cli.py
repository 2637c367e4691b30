"""The ``hetero-plugins`` command: ``demo`` runs the main job, ``bench`` the benchmarks, ``report`` draws what the
balancer did in a run, ``simulate`` / ``pretrain`` / ``pretrain-placement`` / ``pretrain-critic`` / ``transfer`` the
learned scheduler, ``profile-interference`` measures co-location
slowdowns on this machine for it.

Long jobs draw a progress bar on standard error when it is a terminal; ``--quiet`` (anywhere on the line)
turns the bars and per-epoch lines off. Results, and the paths they were written to, are printed either way.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]

COMMANDS = ("demo", "bench", "report", "simulate", "pretrain", "pretrain-placement", "pretrain-critic", "transfer",
            "profile-interference")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quiet" in argv:
        from hetero_plugins.progress import set_quiet

        set_quiet(True)
        argv = [a for a in argv if a != "--quiet"]
    parser = argparse.ArgumentParser(prog="hetero-plugins", description="Heterogeneity-aware data-parallel training.")
    parser.add_argument("command", choices=COMMANDS,
                        help="demo: stock DDP vs HeteroDDPStrategy; bench: benchmarks; report RUN: a picture and a "
                        "summary of what the balancer did in a run; simulate / pretrain / pretrain-placement / "
                        "pretrain-critic / transfer: the learned scheduler on the cluster simulator; "
                        "profile-interference: measure "
                        "co-runner slowdowns here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or per-epoch lines (any position)")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command in ("simulate", "pretrain", "pretrain-placement", "pretrain-critic", "transfer"):
        from hetero_plugins.scheduler import commands

        return getattr(commands, f"{args.command.replace('-', '_')}_main")(argv[1:])
    if args.command == "profile-interference":
        from hetero_plugins.scheduler.profile import profile_main

        return profile_main(argv[1:])
    if args.command == "demo":
        from hetero_plugins.apps.demo import main as demo_main

        return demo_main(argv[1:])
    if args.command == "report":
        from hetero_plugins.apps.report import main as report_main

        return report_main(argv[1:])
    from hetero_plugins.apps.bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
