"""Write crds/elastictrainingjobs.tidal.dev.yaml from the types in tidal_api.

    python tools/gen_crd.py            # rewrite the checked-in CRD and the Helm chart's copy
    python tools/gen_crd.py --check    # exit 1 if either is out of date

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
CHART_CRD_PATH = ROOT / "charts" / "tidal" / "crds" / f"{CRD_NAME}.yaml"  # helm installs it
HEADER = "# Generated from api/tidal_api by tools/gen_crd.py: edit the types, not this file.\n"


def render() -> str:
    """The CRD as the YAML text that is checked in."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    parser.add_argument("path", nargs="?", type=Path, help="this file only")
    args = parser.parse_args(argv)
    text = render()
    paths = [args.path] if args.path else [CRD_PATH, CHART_CRD_PATH]
    if args.check:
        stale = [path for path in paths if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python tools/gen_crd.py", file=sys.stderr)
        return 1 if stale else 0
    for path in paths:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
