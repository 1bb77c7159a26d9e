"""Write crds/elastictrainingjobs.tidal.dev.yaml from the types in tidal_api.

    python tools/gen_crd.py            # rewrite the checked-in CRD
    python tools/gen_crd.py --check    # exit 1 if it is out of date

The YAML writing lives here, not in tidal_api.crd, because tidal_api is stdlib + pydantic only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from tidal_api.crd import CRD_NAME, crd

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / f"{CRD_NAME}.yaml"
HEADER = "# Generated from operator/tidal_api by tools/gen_crd.py: edit the types, not this file.\n"


def render() -> str:
    """The CRD as the YAML text that is checked in."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    parser.add_argument("path", nargs="?", type=Path, default=CRD_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is out of date: run python tools/gen_crd.py", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
