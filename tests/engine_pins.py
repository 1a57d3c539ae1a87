"""Does the project install beside the engines its users run, changing none of their pins?

For each engine, pip resolves (``--dry-run``, metadata only: no wheel is downloaded whole) the
engine alone and the engine with this checkout and its ``cute`` extra; every package of the first
resolution must keep its version in the second. A conflict (ResolutionImpossible) or a moved pin
is reported and the exit code is 1. ``.ci/run`` runs it beside the tests:

    python tests/engine_pins.py [--project '.[cute]'] [ENGINE_REQUIREMENT ...]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ENGINES = ("vllm==0.33.0", "sglang==0.5.23")
PROJECT = str(Path(__file__).resolve().parents[1]) + "[cute]"


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(requirements: list[str]) -> dict[str, str]:
    """{normalized name: version} of what pip would install for ``requirements`` into an empty
    environment; raises RuntimeError with pip's own words when they cannot be resolved together."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                              "--report", str(report), *requirements], capture_output=True, text=True)
        if run.returncode != 0:
            errors = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith(("ERROR", "    "))]
            raise RuntimeError(f"pip cannot install {' '.join(requirements)} together:\n" + "\n".join(errors[-30:]))
        return {_key(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}


def moved_pins(alone: dict[str, str], together: dict[str, str], project: str = "lamport-mhc") -> list[str]:
    """What installing beside the engine changes of the engine's own resolution: a line per package
    whose version differs or that is gone."""
    return [f"{name}: {version} -> {together.get(name, 'not installed')}"
            for name, version in sorted(alone.items()) if name != project and together.get(name) != version]


def check(engine: str, project: str) -> list[str]:
    """The problems of installing ``project`` beside ``engine`` (empty: none)."""
    try:
        alone = resolve([engine])
    except RuntimeError as error:
        return [f"{engine} alone does not resolve here: {error}"]
    try:
        together = resolve([engine, project])
    except RuntimeError as error:
        return [str(error)]
    return [f"beside {engine}: {line}" for line in moved_pins(alone, together)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="*", default=list(ENGINES))
    parser.add_argument("--project", default=PROJECT, help="this project's requirement (default: the checkout "
                                                           "with its cute extra)")
    args = parser.parse_args(argv)
    with ThreadPoolExecutor(len(args.engines)) as pool:
        problems = dict(zip(args.engines, pool.map(lambda engine: check(engine, args.project), args.engines)))
    for engine, found in problems.items():
        print(f"{args.project} beside {engine}: " + ("resolves, every pin kept" if not found else "FAILS"))
        for line in found:
            print(f"  {line}")
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
