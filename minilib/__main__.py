"""Command line: `python -m minilib doctor`, `... bench [options]`, `... compile [options]`.

Exit codes: 0 when all went well; 1 when the doctor's check, a benchmark row or a compile
failed; 2 for a usage error (an unknown command, a bad flag), with a one-line message.
"""

from __future__ import annotations

import argparse
import sys

from minilib.doctor import doctor, tpu_self_check
from minilib.perf import bench
from minilib.tpu import comparison


class CommandLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is long): which flag, what is wrong."""

    def error(self, message: str):
        # argparse calls an unknown command "an invalid choice" of the COMMAND argument.
        message = message.replace("argument COMMAND: invalid choice", "unknown command")
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run_doctor(args) -> int:
    """`python -m minilib doctor [--tpu [--interpret] [--no-ladder]]`: 0 when every check passes,
    else 1."""
    if (args.interpret or args.no_ladder) and not args.tpu:
        args.parser.error("--interpret and --no-ladder go with --tpu, as in: python -m minilib "
                          "doctor --tpu --interpret")  # fmt: skip
    if args.tpu:
        return 0 if tpu_self_check(interpret=args.interpret, ladder=not args.no_ladder) else 1
    return 0 if doctor() else 1


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m minilib`: one subparser per command, with its own flags."""
    parser = CommandLineParser(prog="python -m minilib")
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", required=True
    )
    doctor_parser = commands.add_parser(
        "doctor",
        help="where you are running (cpu or tpu), versions, interpreted or compiled kernel, "
        "and a parity check against JAX's reference",
        description="Where you are running and whether the kernel agrees with the reference.",
    )
    doctor_parser.add_argument(
        "--tpu",
        action="store_true",
        help="the self-check to run once on a real TPU: every implementation and ladder "
        "solution compiled and run, parity at the chip's precision, our kernel timed beside "
        "JAX's and vLLM's v3 on a decode, a mixed and a prefill batch; a report to paste",
    )
    doctor_parser.add_argument(
        "--interpret",
        action="store_true",
        help="with --tpu, off a TPU: run the same checks with the kernels in TPU interpret mode "
        "(right answers, not TPU speed)",
    )
    doctor_parser.add_argument(
        "--no-ladder",
        action="store_true",
        help="with --tpu: leave out the ladder's checkers (about a minute in interpret mode)",
    )
    doctor_parser.set_defaults(run=run_doctor, parser=doctor_parser)
    bench_parser = commands.add_parser(
        "bench",
        help="time the ragged paged attention implementations on the same batches",
        description="Time the ragged paged attention implementations; see minilib/perf/bench.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run, parser=bench_parser)
    compile_parser = commands.add_parser(
        "compile",
        help="compile our kernel and JAX's for a TPU chip, without a TPU (needs libtpu), and "
        "compare bundles per KV block, VMEM and spills",
        description=comparison.COMMAND_DESCRIPTION,
    )
    comparison.add_arguments(compile_parser)
    compile_parser.set_defaults(run=run_compile)
    return parser


def run_compile(args) -> int:
    """`python -m minilib compile`: the levers table with `--levers`, else the comparison."""
    if args.levers:
        from minilib.tpu import lever_costs

        return lever_costs.run(args)
    return comparison.run(args)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # argparse would first say that COMMAND is missing, which hides the real mistake.
        parser.error(f"unrecognized argument {argv[0]}: a command comes first (doctor, bench "
                     "or compile), then its flags")  # fmt: skip
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
