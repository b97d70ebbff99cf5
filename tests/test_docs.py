"""The reference page is complete, and the repository points nowhere outside itself.

``docs/reference.md`` is the project's contract. These checks read the code's
own definitions (the argparse parser, the metric registry and the metric names in
the source, the response specs) so that a new flag, metric or error code fails
the suite until the reference documents it.
"""

from __future__ import annotations

import argparse
import ast
import enum
import fnmatch
import importlib
import pkgutil
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import sidecar
from sidecar.config import build_parser
from sidecar.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"

# Joined at run time so that this file does not match its own check.
OUTSIDE_POINTERS = ("../" + "shared", "shared/" + "reference", "CONTRACT" + ".md")

# The contract's error codes: documented whether or not a module defines them
# as a response (499 is counted, never delivered).
CONTRACT_CODES = {
    "scheduler_queue_full", "scheduler_queue_timeout", "scheduler_preempted",
    "scheduler_client_cancelled", "admission_queue_full", "admission_queue_timeout",
}
# Codes a response module must define: proves the response scan below is not blind.
DELIVERED_CODES = CONTRACT_CODES - {"scheduler_client_cancelled"}

CLASS_NAMES = ("system", "interactive", "default", "bulk")


def reference() -> str:
    return REFERENCE.read_text(encoding="utf-8")


def table_rows(text: str) -> list[list[str]]:
    """Markdown table body rows as lists of stripped cells (header and separator dropped)."""
    rows = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or _is_separator(line):
            continue
        if i + 1 < len(lines) and _is_separator(lines[i + 1]):
            continue  # a header row
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _is_separator(line: str) -> bool:
    return line.startswith("|") and re.fullmatch(r"[|\s:-]+", line) is not None


# ------------------------------------------------------------------ self-contained


def repo_files() -> list[Path]:
    """Files in the repository: tracked, plus new ones git does not ignore."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        # Not a git checkout (e.g. an unpacked archive): walk it, skipping tool state.
        skip = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                "build", "dist"}
        return [p for p in ROOT.rglob("*") if p.is_file()
                and not any(part in skip or part.startswith(".venv") or part.endswith(
                    ".egg-info") for part in p.relative_to(ROOT).parts)]
    names = {n for n in out.decode().split("\0") if n}
    return sorted(ROOT / n for n in names if (ROOT / n).is_file())


def test_the_file_scan_sees_the_repository() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in repo_files()}
    assert {"README.md", "docs/reference.md", "tests/test_docs.py"} <= files


def test_no_file_points_outside_the_repository() -> None:
    offenders = []
    for path in repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (plots)
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{path.relative_to(ROOT)}:{lineno}: {needle}"
                          for needle in OUTSIDE_POINTERS if needle in line]
    assert not offenders, "pointers to files outside the repository:\n" + "\n".join(offenders)


def test_readme_links_the_reference() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/reference.md)" in readme


def doc_pages() -> list[str]:
    """The pages a reader follows links through: README, docs/, the recipes' READMEs, envoy/."""
    pages = {"README.md"} | {p.relative_to(ROOT).as_posix() for p in repo_files()
                             if p.suffix == ".md" and p.parent in (ROOT / "docs", ROOT / "envoy")}
    pages |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "k8s").rglob("README.md")}
    return sorted(pages)


def test_the_page_scan_sees_the_pages() -> None:
    assert {"README.md", "docs/reference.md", "docs/design.md", "docs/operations.md",
            "docs/performance.md", "k8s/README.md", "envoy/NOTES.md"} <= set(doc_pages())


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", doc_pages())
def test_links_resolve(page: str) -> None:
    """Every relative link leads to a file, and every ``#anchor`` to a heading of its page."""
    source = ROOT / page
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page}: broken links: {broken}"


def _github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


# --------------------------------------------------------------------------- flags


def parser_flags() -> Iterator[tuple[str, argparse.Action]]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        assert longs, f"flag without a long name: {action.option_strings}"
        yield longs[0], action


def flag_rows() -> dict[str, list[str]]:
    """Flag tables: the first cell names the flag (with its metavar), the second its default."""
    rows: dict[str, list[str]] = {}
    for row in table_rows(reference()):
        m = re.match(r"`(--[a-z0-9-]+)", row[0])
        if m and len(row) >= 3:
            rows.setdefault(m.group(1), row)
    return rows


def test_flag_scan_finds_the_flags() -> None:
    flags = {name for name, _ in parser_flags()}
    assert {"--priority-scheduler-enabled", "--max-concurrent-requests",
            "--grpc-listen", "--tenant-source"} <= flags


def test_the_flag_tables_are_written_from_the_flags() -> None:
    """The reference's flag tables are what the flags' one declaration makes."""
    from devtools import flagdoc

    assert flagdoc.current(reference()) == flagdoc.tables().strip(), (
        "docs/reference.md's flag tables are out of date: run python -m devtools.flagdoc")


@pytest.mark.parametrize("flag", [name for name, _ in parser_flags()])
def test_every_flag_has_a_row_in_the_reference(flag: str) -> None:
    assert flag in flag_rows(), f"{flag} has no row in a flag table of docs/reference.md"


@pytest.mark.parametrize(("flag", "action"), list(parser_flags()))
def test_documented_flag_defaults_match_the_parser(flag: str, action: argparse.Action) -> None:
    row = flag_rows().get(flag)
    if row is None:
        pytest.fail(f"{flag} is not documented")
    cell = row[1]
    default = action.default
    if default is None or default == []:
        assert cell, f"{flag}: say what unset means"
    elif isinstance(default, bool):
        assert ("on" if default else "off") in cell, f"{flag}: default {default} vs {cell!r}"
    elif isinstance(default, int | float):
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", cell)]
        assert float(default) in numbers, f"{flag}: default {default} vs {cell!r}"
    else:
        assert str(default) in cell, f"{flag}: default {default!r} vs {cell!r}"


# ------------------------------------------------------------------------- metrics


def _documented(name: str, text: str) -> bool:
    # A counter registered as NAME is exposed as NAME_total; NAME must not match a
    # longer metric name (smg_sidecar_capacity vs smg_sidecar_capacity_source).
    return re.search(rf"(?<![\w]){re.escape(name)}(?:_total)?(?![\w])", text) is not None


def source_metric_names() -> set[str]:
    """Every ``smg_*`` string literal in the package: registered and scrape-time metrics."""
    names: set[str] = set()
    package = Path(sidecar.__file__).parent
    for path in package.rglob("*.py"):
        if "devtools" in path.relative_to(package).parts:
            continue  # the dev tools are not the product
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"smg_[a-z0-9_]*[a-z0-9]", node.value):
                names.add(node.value)
    return names


def registered_metric_names() -> set[str]:
    try:
        metrics = Metrics(tenant_top_n=32)
    except TypeError as exc:  # the constructor changed: teach this helper its arguments
        pytest.fail(f"cannot build sidecar.metrics.Metrics for the docs check: {exc}")
    return {family.name for family in metrics.registry.collect()}


def test_metric_scan_sees_every_registered_metric() -> None:
    registered = registered_metric_names()
    assert "smg_scheduler_admit" in registered
    assert registered <= source_metric_names()
    # Scrape-time gauges are not registered until a core is watched: the scan has them.
    assert {"smg_scheduler_inflight", "smg_scheduler_class_capacity_pressure"} \
        <= source_metric_names()


@pytest.mark.parametrize("name", sorted(source_metric_names()))
def test_every_metric_is_in_the_reference(name: str) -> None:
    assert _documented(name, reference()), f"metric {name} is not in docs/reference.md"


def test_every_registered_metric_is_in_the_reference() -> None:
    text = reference()
    missing = sorted(n for n in registered_metric_names() if not _documented(n, text))
    assert not missing, f"registered metrics missing from docs/reference.md: {missing}"


def test_metric_tables_give_type_and_labels() -> None:
    """Each metric's table row says counter/gauge/histogram."""
    types = {"counter", "gauge", "histogram"}
    rows = {m.group(1): row for row in table_rows(reference())
            if (m := re.fullmatch(r"`(smg_[a-z0-9_]+)`", row[0]))}
    for name in source_metric_names():
        row = rows.get(name) or rows.get(f"{name}_total")
        assert row is not None, f"{name} has no row in a metrics table"
        assert row[1] in types, f"{name}: type column says {row[1]!r}"


# ----------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Response:
    status: int
    code: str
    message: str
    headers: tuple[tuple[str, str], ...]


def _sidecar_modules() -> Iterator[object]:
    for info in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
        # __main__ would run the CLI; the dev tools are not the product.
        if info.name.endswith("__main__") or ".devtools" in info.name:
            continue
        yield importlib.import_module(info.name)


def response_specs() -> set[Response]:
    """Every object in the package that looks like a response: an HTTP error status and
    a code, found in module globals, containers and enums, whatever the module is called."""
    found: set[Response] = set()
    seen: set[int] = set()

    def visit(obj: object, depth: int) -> None:
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        status, code = getattr(obj, "status", None), getattr(obj, "code", None)
        if isinstance(status, int) and not isinstance(status, bool) \
                and 400 <= status < 600 and isinstance(code, str):
            raw = getattr(obj, "headers", ())
            pairs = tuple(h for h in raw if isinstance(h, tuple) and len(h) == 2) \
                if isinstance(raw, list | tuple) else ()
            message = getattr(obj, "message", "")
            found.add(Response(status, code, message if isinstance(message, str) else "",
                               pairs))
            return
        if isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, list | tuple | set | frozenset):
            for v in obj:
                visit(v, depth + 1)
        elif isinstance(obj, type) and issubclass(obj, enum.Enum):
            for member in obj:
                visit(member, depth + 1)
        elif isinstance(obj, enum.Enum):
            visit(obj.value, depth + 1)

    for module in _sidecar_modules():
        for value in vars(module).values():
            if isinstance(value, type) and not (
                    issubclass(value, enum.Enum) and value.__module__.startswith("sidecar")):
                continue
            visit(value, 0)
    return found


def test_response_scan_finds_the_responses() -> None:
    assert {r.code for r in response_specs()} >= DELIVERED_CODES


@pytest.mark.parametrize("code", sorted(CONTRACT_CODES))
def test_every_contract_code_is_in_the_reference(code: str) -> None:
    assert f"`{code}`" in reference()


def _rows_for(code: str, status: int) -> list[list[str]]:
    return [row for row in table_rows(reference())
            if row[0] == str(status) and f"`{code}`" in row[1:3]]


@pytest.mark.parametrize("response", sorted(response_specs(), key=repr), ids=repr)
def test_every_response_is_documented(response: Response) -> None:
    """Status, code, extra headers and message, in one row of the responses table."""
    rows = _rows_for(response.code, response.status)
    assert rows, f"no '| {response.status} | `{response.code}` |' row in docs/reference.md"
    wanted = [f"{k}: {v}".lower() for k, v in response.headers
              if k.lower() not in ("x-smg-error-code", "content-type")]
    message = response.message
    for cls in CLASS_NAMES:
        message = message.replace(f"'{cls}'", "'<class>'")
    for row in rows:
        joined = " | ".join(row).lower()
        if all(h in joined for h in wanted) and f"`{message}`".lower() in joined:
            return
    pytest.fail(f"no row documents {response} with its headers {wanted} and message "
                f"{message!r}")


def test_no_tracker_numbers_in_the_repository() -> None:
    """Code, docs and configs explain themselves; an issue number means nothing to a reader
    of the repository (the tracker is not in it)."""
    pattern = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
    found = []
    for path in repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (plots)
        found += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                  if pattern.search(line)]
    assert not found, found


DESIGN = ROOT / "docs" / "design.md"


def _design_section(heading: str) -> str:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_the_test_table_names_every_test_file() -> None:
    """The design page's table of test files is the map a contributor reads: no file
    missing, none that is gone (``test_ledger*.py`` style names cover a family)."""
    table = _design_section("Tests")
    named = set(re.findall(r"`(?:tests/)?(test_[a-z0-9_*]+\.py)`", table))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    covered = {f for f in files if any(fnmatch.fnmatch(f, n) for n in named)}
    assert files == covered, f"not in the test table of docs/design.md: {sorted(files - covered)}"
    gone = {n for n in named if not any(fnmatch.fnmatch(f, n) for f in files)}
    assert not gone, f"in the test table of docs/design.md but not in tests/: {sorted(gone)}"


def test_the_module_map_names_every_module() -> None:
    """Every module of the package is in the design page's module map (by its path, or by
    its file name in its package's row), and every path the map names exists."""
    table = _design_section("Module map")
    named = set(re.findall(r"`((?:sidecar|devtools|envoy|bench|k8s)/[\w/.]*)`", table))
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, f"in the module map of docs/design.md but not in the tree: {gone}"
    missing = []
    for path in sorted((ROOT / "sidecar").rglob("*")):
        if path.suffix not in (".py", ".lua") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != ROOT / "sidecar":
            rel = path.parent.relative_to(ROOT).as_posix() + "/"
        elif path.name == "__init__.py":
            continue
        package_row = path.parent != ROOT / "sidecar" and f"`{path.name}`" in table
        if f"`{rel}`" not in table and not package_row:
            missing.append(rel)
    assert not missing, f"not in the module map of docs/design.md: {missing}"
