"""Command line: `python -m minilib doctor`, `... bench [options]`, `... compile [options]`."""

from __future__ import annotations

import sys

USAGE = """usage: python -m minilib COMMAND

commands:
  doctor   where you are running (cpu or tpu), versions, interpreted or compiled kernel,
           and a one-second parity check
  bench    the benchmark harness (python -m minilib bench --help)
  compile  compile our kernel and JAX's for a TPU chip, without a TPU (needs libtpu), and
           compare bundles per KV block, VMEM and spills (python -m minilib compile --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from minilib.doctor import doctor

        return 0 if doctor() else 1
    if command == "bench":
        from minilib.bench import main as bench_main

        return bench_main(rest)
    if command == "compile":
        from minilib.kernel_costs import main as compile_main

        return compile_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
