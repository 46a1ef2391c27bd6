"""Print `name==floor` for each runtime dependency in pyproject.toml: the oldest versions kvserve
claims to support, for `make test-floors` to install. Read from pyproject each time, so the pins
can never drift from what the package declares.

    python tests/floors/pins.py --except torch   # torch's floor cannot be installed here (Makefile)
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# "name>=1.2" or "name[extra]>=1.2,<2": the name and the floor; markers after ";" are not used here.
_FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*>=\s*([^,;\s]+)")


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{name: floor} for every runtime dependency; one without a `>=` floor is an error."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out: dict[str, str] = {}
    for dep in deps:
        match = _FLOOR.match(dep)
        if match is None:
            raise SystemExit(f"{pyproject}: dependency {dep!r} has no '>=' floor; give it one")
        out[match.group(1)] = match.group(3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--except", dest="skip", action="append", default=[], metavar="NAME",
                        help="leave this dependency out (repeatable)")
    args = parser.parse_args(argv)
    skip = {name.lower() for name in args.skip}
    for name, floor in floors().items():
        if name.lower() not in skip:
            print(f"{name}=={floor}")


if __name__ == "__main__":
    main(sys.argv[1:])
