"""The README as a newcomer uses it: its commands work as written on a fresh clone, its sample
output is what a fresh run prints, and every link and repository path in README.md and
docs/*.md resolves.

The README's shell blocks (```sh, ```bash, ```console) are extracted and every command in them
is checked. A command this file does not know how to check fails the test, so a new command in
the README comes with its check here.

Run for real, from the repository root, with the virtual environment's bin/ first on the PATH
(what ``. .venv/bin/activate`` does):

- ``tidal plan ...``, ``tidal run ...`` and ``tidal sim ...`` (on a trace under traces/,
  as next to a fresh clone): each exits 0, and every output line the README shows under it
  comes out, in order (``...`` skips lines; seconds, milliseconds, tokens/s, percentages and
  the parameter digest are masked: they change from run to run and machine to machine);
- ``tidal local up`` with the kubectl and helm commands of the tour against it, in their
  order, each exiting 0: local up as a process in a temporary --workdir, on one node of one GPU
  slot with no arrivals and no live view (one agent starts, not four), stopped with Ctrl-C
  (SIGINT) once the commands have run, exiting 0; ``export KUBECONFIG=...`` is checked to name
  local up's default kubeconfig and is pointed at the temporary one;
- ``. .venv/bin/activate``: the file is there, next to ``tidal``, ``kubectl`` and ``helm``.

Checked otherwise, being minutes long:

- ``make test`` and ``make demo``: ``make -n`` of the target runs the documented command, and
  the tests that exercise them exist: the set-up test and the e2e demo test
  (``tests/e2e/test_demo.py`` runs a one-minute demo through the same code);
- ``tidal local up`` as written (its defaults: 2 nodes of 4 GPUs and arrivals): its --help
  parses, and the e2e test that runs it and the chart test that installs helm over it exist.

And: the README stays a short tour (at most 200 lines) that links every page under docs/;
relative links (anchors included) resolve from their page; every repository path and
``file::test`` quoted in code resolves from the root; every
``tidal_*`` module and ``*.py`` file named exists; the upper bounds docs/agent.md documents are
the CRD's.
"""

from __future__ import annotations

import ast
import glob
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import tools
from tidal_api.crd import crd
from tidal_cli import main as tidal_group

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BIN = Path(sys.executable).parent  # the virtual environment's bin/, where the set-up puts tools
SOURCE_ROOTS = ("api", "agent", "operator", "doubles")
# Top-level entries that are not the repository's own (outputs, environments, caches).
NOT_REPOSITORY = {".git", ".venv", "runs", ".hypothesis", ".pytest_cache", "__pycache__", "build"}

# The tests behind the commands that are too long to run here: (file, function).
EXERCISED_BY = {
    "make test": [("tests/e2e/test_local_parts.py",
                   "test_the_set_up_puts_kubectl_and_helm_in_the_venv_and_installs_prometheus")],
    "make demo": [("tests/e2e/test_demo.py",
                   "test_demo_grows_and_shrinks_through_the_operator_bitwise_as_a_static_run")],
    "tidal local up": [("tests/e2e/test_demo.py", "test_local_up_stops_everything_it_started"),
                       ("tests/integration/test_chart.py",
                        "test_helm_installs_as_documented_over_what_tidal_local_up_created")],
}
MAKE_RECIPES = {"test": ".venv/bin/python -m pytest -n 2 --dist worksteal",
                "demo": ".venv/bin/tidal local demo --job examples/demo.yaml --minutes 3 "
                        "--report runs/demo.json"}


@dataclass(frozen=True)
class Command:
    """One command of a README block: its words (``.venv/bin/`` dropped, comments dropped) and,
    in a console block, the output the README shows under it."""

    line: str
    argv: tuple[str, ...]
    shown: tuple[str, ...] = ()


def readme_commands(text: str) -> list[Command]:
    commands = []
    for kind, body in re.findall(r"^```(sh|bash|console)\n(.*?)^```", text, re.M | re.S):
        if kind != "console":
            commands += [_command(line) for line in body.splitlines()]
            continue
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            line, *shown = chunk.rstrip("\n").split("\n")
            commands.append(_command(line, tuple(shown)))
    return [c for c in commands if c.argv]


def _command(line: str, shown: tuple[str, ...] = ()) -> Command:
    argv = shlex.split(line, comments=True)
    if argv and argv[0].startswith(".venv/bin/"):
        argv[0] = argv[0].removeprefix(".venv/bin/")
    return Command(line.strip(), tuple(argv), shown)


COMMANDS = readme_commands(README.read_text())


def _id(command: Command) -> str:
    return " ".join(command.argv)[:60]


def test_the_readme_is_a_short_tour_with_few_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert 0 < len(COMMANDS) <= 20, [c.line for c in COMMANDS]
    linked = set(re.findall(r"\]\((docs/[^)#]+)", README.read_text()))
    assert {f"docs/{page.name}" for page in DOCS} <= linked, "a docs page the README never links"


def test_every_readme_command_has_a_check():
    for command in COMMANDS:
        assert _kind(command) is not None, f"no check for the README's command {command.line!r}"


def _kind(command: Command) -> str | None:
    argv = command.argv
    if argv[0] == "make" and len(argv) == 2 and argv[1] in MAKE_RECIPES:
        return "make"
    if argv[:2] in ((".", ".venv/bin/activate"), ("source", ".venv/bin/activate")):
        return "activate"
    if argv[0] == "tidal" and argv[1] in ("plan", "sim", "run"):
        return "tidal"
    if argv[:3] == ("tidal", "local", "up") or argv[0] in ("kubectl", "helm", "export"):
        return "tour"
    return None


# ---- checked otherwise: make ---------------------------------------------------------------------


def _defined(path: str, function: str) -> bool:
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == function
               for node in ast.walk(tree))


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) == "make"], ids=_id)
def test_make_targets_run_what_the_readme_says(command):
    target = command.argv[1]
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert MAKE_RECIPES[target] in done.stdout.splitlines(), done.stdout
    setup = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "python3 -m venv .venv" in setup.stdout.splitlines(), setup.stdout  # makes .venv
    for path, function in EXERCISED_BY[f"make {target}"]:
        assert _defined(path, function), f"{path}::{function} is gone"


def test_activate_puts_tidal_kubectl_and_helm_on_the_path():
    if not any(_kind(c) == "activate" for c in COMMANDS):
        pytest.skip("the README activates no environment")
    tools.kubectl(), tools.helm()  # the set-up's; extracted now where it has not run
    assert (BIN / "activate").is_file()
    for name in ("tidal", "tidal-operator", "kubectl", "helm"):
        assert os.access(BIN / name, os.X_OK), f"{name} is not in {BIN}"


# ---- run for real: tidal plan, sim, run ------------------------------------------------------


def _masked(line: str) -> str:
    line = re.sub(r"\d[\d,.]*( ?(ms|tok/s|s)\b)", r"#\1", line)
    line = re.sub(r"[-+]?\d+%", "#%", line)
    line = re.sub(r"\b[0-9a-f]{16}\b", "#", line)
    return " ".join(line.split())


def shown_lines_appear_in_order(shown: tuple[str, ...], printed: str) -> list[str]:
    """The README's shown lines (``...`` skips any number of lines) that a run did not print,
    in order."""
    lines = iter(_masked(line) for line in printed.splitlines())
    missing = []
    for want in shown:
        if want.strip() == "...":
            continue
        if not any(got == _masked(want) for got in lines):
            missing.append(want)
            break
    return missing


def test_the_output_comparison_can_fail():
    printed = "a\nstep 1 loss 2.0000 12.5 ms\nb\nstep 2 loss 1.5000 9.1 ms\n"
    assert shown_lines_appear_in_order(("step 1 loss 2.0000 99.0 ms", "..."), printed) == []
    assert shown_lines_appear_in_order(("step 2 loss 1.5000 1 ms", "step 1 loss 2.0000 1 ms"),
                                       printed) == ["step 1 loss 2.0000 1 ms"]
    assert shown_lines_appear_in_order(("step 1 loss 2.0001 12.5 ms",), printed)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) == "tidal"], ids=_id)
def test_tidal_commands_run_as_written(command):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}
    done = subprocess.run(list(command.argv), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    missing = shown_lines_appear_in_order(command.shown, done.stdout + done.stderr)
    assert not missing, f"the README shows {missing[0]!r}; a fresh run printed:\n{done.stdout}"


# ---- the tour: tidal local up, kubectl and helm -------------------------------------------------


def _local_up_command():
    return tidal_group.commands["local"].commands["up"]  # `tidal local` is mounted in a checkout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tour_runs_against_tidal_local_up(tmp_path):
    tour = [c for c in COMMANDS if _kind(c) == "tour"]
    ups = [c for c in tour if c.argv[:3] == ("tidal", "local", "up")]
    if not ups:
        pytest.skip("the README's tour has no tidal local up")
    (up_command,) = ups
    for path, function in EXERCISED_BY["tidal local up"]:
        assert _defined(path, function), f"{path}::{function} is gone"
    helped = subprocess.run([str(BIN / "tidal"), *up_command.argv[1:], "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr

    # `export KUBECONFIG=$PWD/...` names the kubeconfig local up writes by default: in its
    # default --workdir (that it goes to WORKDIR/kubeconfig, the run below shows).
    defaults = {p.name: p.default for p in _local_up_command().params}
    default_kubeconfig = Path(defaults["workdir"]) / "kubeconfig"
    for export in (c for c in tour if c.argv[0] == "export"):
        assert export.argv[1:] == (f"KUBECONFIG=$PWD/{default_kubeconfig}",), export.line

    workdir = tmp_path / "local"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "helm-config"),
           "HELM_DATA_HOME": str(tmp_path / "helm-data")}
    tools.kubectl(), tools.helm()
    up = subprocess.Popen(
        [str(BIN / "tidal"), *up_command.argv[1:], "--nodes", "1", "--gpus-per-node", "1",
         "--arrival-rate", "0", "--workdir", str(workdir), "--no-live"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = up.stdout.readline().strip()
        assert first == f"export KUBECONFIG={(workdir / 'kubeconfig').resolve()}", first
        env["KUBECONFIG"] = str(workdir / "kubeconfig")
        for command in tour:
            if command.argv[0] in ("kubectl", "helm"):
                done = subprocess.run(list(command.argv), cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, f"{command.line}: {done.stderr}"
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=90)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, err[-3000:]


# ---- links and paths in README.md and docs/*.md --------------------------------------------------


def _pages() -> list[Path]:
    return [README, *DOCS]


def _outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return heading.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", _outside_fences(page.read_text()), re.M)}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_no_page_reaches_outside_the_repository(page):
    """A user's clone stands alone: nothing beside it (a ``shared/`` folder) is linked or used."""
    beside = f"{os.pardir}/shared"  # the folder a workplace keeps next to its clone
    assert beside not in page.read_text(), f"{page.name} points outside the repository"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """Relative to the page, as GitHub resolves them."""
    text = _outside_fences(page.read_text())
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page.name != "README.md"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, f"{page.name}: links that do not resolve: {broken}"


def _code(text: str) -> list[str]:
    """Inline code spans and fenced blocks: where the pages quote paths and names."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    inline = re.findall(r"`([^`\n]+)`", _outside_fences(text))
    return fenced + inline


def _words(text: str) -> set[str]:
    words = set()
    for code in _code(text):
        # words end at blanks and punctuation, but {a,b} stays whole
        for word in re.findall(r"(?:\{[^{}\s]*\}|[^\s,;()\[\]\"'=])+", code):
            words.add(word.rstrip(".:"))
    return words - {""}


def _braces(pattern: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _repository_tops() -> set[str]:
    return {p.name for p in ROOT.iterdir()
            if p.name not in NOT_REPOSITORY and not p.name.endswith(".egg-info")}


def repository_paths(text: str) -> list[str]:
    """Words that name a file or folder of the repository: their first part
    is a top-level entry of the repository or a package under a source root (``tidal_x/``)."""
    tops = _repository_tops()
    return sorted(w for w in _words(text) if "/" in w and (
        w.split("/")[0] in tops or w.startswith("tidal_")))


def _resolves(word: str) -> bool:
    path, _, function = word.partition("::")
    pattern = re.sub(r"<[^>]*>", "*", path)
    bases = [ROOT] + [ROOT / root for root in SOURCE_ROOTS] * path.startswith("tidal_")
    found = [(base, hit) for base in bases for p in _braces(pattern)
             for hit in glob.glob(str(base / p))]
    if not found:
        return False
    return not function or _defined(str(Path(found[0][1]).relative_to(ROOT)), function)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_repository_path_resolves_from_the_root(page):
    """Paths quoted in code: from the repository root, where the commands run.
    ``file::test`` names a test that must exist;
    ``<placeholder>``, ``*`` and ``{a,b}`` match what they stand for."""
    missing = [w for w in repository_paths(page.read_text()) if not _resolves(w)]
    assert not missing, f"{page.name} quotes paths that do not exist: {missing}"


def _module_file(dotted: str) -> bool:
    """``tidal_x.y.z``: a module under a source root, or a name defined in one."""
    parts = dotted.split(".")
    for root in SOURCE_ROOTS:
        base = ROOT / root
        for i in range(len(parts), 0, -1):
            here = base.joinpath(*parts[:i])
            module = here / "__init__.py" if here.is_dir() else here.with_suffix(".py")
            if module.is_file():
                rest = parts[i:]  # at most a name the module defines or imports
                return not rest or (len(rest) == 1 and re.search(
                    rf"\b{re.escape(rest[0])}\b", module.read_text()) is not None)
    return False


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_module_and_file_name_exists(page):
    """``tidal_agent.snapshot``, ``tidal_api.ScaleTable``, ``costmodel.py``: the modules and
    files the pages name are still there after a move."""
    words = _words(page.read_text())
    modules = sorted(w for w in words if re.fullmatch(r"tidal_\w+(\.\w+)+", w))
    missing = [m for m in modules if not _module_file(m)]
    files = sorted(w for w in words if re.fullmatch(r"[\w-]+\.py", w))
    tracked = {p.name for root in (*SOURCE_ROOTS, "tests", "bench", "tools")
               for p in (ROOT / root).rglob("*.py")}
    missing += [f for f in files if f not in tracked]
    assert not missing, f"{page.name} names modules or files that do not exist: {missing}"


def test_the_path_checks_can_fail():
    assert repository_paths("`bench/nonesuch.py` and `runs/demo.json`") == ["bench/nonesuch.py"]
    assert not _resolves("bench/nonesuch.py")
    assert not _resolves("tests/e2e/test_demo.py::test_nonesuch")
    assert _resolves("examples/scale-tables/flextrain-{small,large}-<kind>.json")
    assert not _module_file("tidal_agent.nonesuch")
    assert _module_file("tidal_api.ScaleTable")


# ---- the documented bounds of the job file --------------------------------------------------------


def _maxima(node: dict, path: str = "") -> dict[str, float]:
    found = {path: node["maximum"]} if "maximum" in node else {}
    for key, sub in (node.get("properties") or {}).items():
        found |= _maxima(sub, f"{path}.{key}" if path else key)
    return found


def test_the_documented_upper_bounds_are_the_crds():
    """docs/agent.md's table of upper bounds lists every count and size the CRD bounds, with the
    CRD's maximum (fractions, bounded by 1, are left out)."""
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    maxima = {path: bound for path, bound in _maxima(schema).items() if bound > 1}
    documented = {}
    for fields, bound in re.findall(r"^\| (`[^|]+`) \| ([\d,]+)\b[^|]* \|$",
                                    (ROOT / "docs" / "agent.md").read_text(), re.M):
        for field in re.findall(r"`([^`]+)`", fields):
            documented[field] = int(bound.replace(",", ""))
    assert documented == maxima
