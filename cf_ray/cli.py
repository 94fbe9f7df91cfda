"""The ``cf-ray`` command: ``demo`` (the main job), ``bench``, ``ls`` and ``profile``."""

from __future__ import annotations

import argparse
import sys


def _ls(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cf-ray ls", description="List a run's committed checkpoints.")
    p.add_argument("run", help="the run directory (<storage_path>/<name>), its cf_ray root, or a URI")
    args = p.parse_args(argv)
    from cf_ray.load import list_checkpoints

    infos = list_checkpoints(args.run)
    if not infos:
        print(f"no committed checkpoints under {args.run}")
        return 1
    print(f"{'step':>10} {'epoch':>6} {'kind':>10} {'milestone':>9} {'ranks':>5}  path")
    for c in infos:
        print(f"{c.step:>10} {c.epoch:>6} {c.kind:>10} {str(c.milestone):>9} {c.world_size:>5}  {c.path}")
    return 0


def _profile(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cf-ray profile", description="Print a run's checkpoint profile table.",
                                usage="cf-ray profile RUN | cf-ray profile STORAGE_PATH RUN_NAME")
    p.add_argument("where", nargs="+", metavar="RUN",
                   help="the run directory (<storage_path>/<name>) or a URI; or the two arguments storage_path "
                        "and run_name, as given to RunConfig")
    args = p.parse_args(argv)
    if len(args.where) > 2:
        p.error("give RUN (<storage_path>/<name>) or STORAGE_PATH RUN_NAME")
    from cf_ray.run import Run

    run = Run.from_path(args.where[0]) if len(args.where) == 1 else Run(*args.where)
    print(run.profile().to_string(index=False))
    return 0


def _bench(argv: list[str]) -> int:
    """The benchmark lives in the repository's ``benchmarks/`` package, not in the installed one."""
    try:
        from benchmarks.bench import main as bench_main
    except ImportError:
        import pathlib

        root = pathlib.Path(__file__).resolve().parents[1]
        if not (root / "benchmarks" / "bench.py").exists():
            print("cf-ray bench runs from a clone of the cf_ray repository (it is not part of the installed "
                  "package): git clone it, `pip install -e .` there and run `cf-ray bench` again", file=sys.stderr)
            return 2
        sys.path.insert(0, str(root))
        from benchmarks.bench import main as bench_main
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the main job: a TorchTrainer run with a worker SIGKILLed part-way",
                "bench": "benchmark cf_ray against Ray Train's own checkpointing and DCP",
                "ls": "list a run's committed checkpoints",
                "profile": "print a run's checkpoint profile table"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: cf-ray {" + ",".join(commands) + "} [options]\n")
        for k, v in commands.items():
            print(f"  {k:<8} {v}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from cf_ray.demo import main as demo_main

        return demo_main(rest)
    if cmd == "bench":
        return _bench(rest)
    if cmd == "ls":
        return _ls(rest)
    return _profile(rest)


if __name__ == "__main__":
    sys.exit(main())
