"""Where the CPU of a JVM flight recording went, by kind of work, on Spark's task threads and the driver's.

    python -m jobs.dev.cpuprofile RECORDING.jfr [RECORDING.jfr ...]

The benchmark's ``--profile`` writes one recording per run (under its work folder, ``profiles/``) and prints this
summary per 1,000 changes; any recording of a replica's JVM reads as well (``-XX:StartFlightRecording``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from replica_dev.cpuprofile import ProfileError, read, table


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cpuprofile", description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+", help="flight recordings (.jfr)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.is_file()]
    if missing:
        print(f"cpuprofile: {', '.join(missing)} not found (give recordings written by JFR)", file=sys.stderr)
        return 2
    try:
        profiles = {path.stem: read(path).as_dict() for path in args.paths}
    except ProfileError as exc:
        print(f"cpuprofile: {exc}", file=sys.stderr)
        return 2
    for line in table(profiles):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
