"""The wheel (and so the image, built from it) holds the product and nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_sidecar_package(tmp_path: Path) -> None:
    # Build from a copy of the checkout (like the Dockerfile's build context): a
    # developer's stale build/ directory must not decide the outcome either way.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache", "bench"))
    out = tmp_path / "wheels"
    cp = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert cp.returncode == 0, cp.stderr[-3000:]
    [wheel] = out.glob("priority_gate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    product = {n for n in names if not n.startswith("priority_gate-")}
    assert product, names
    assert all(n.startswith("sidecar/") for n in product), sorted(product)
    modules = {Path(n).stem for n in product} | {Path(n).parent.name for n in product}
    assert {"main", "app", "scheduler", "health", "adminhttp"} <= modules
    for dev_only in ("fleet", "stack", "demo", "httpclient", "proc", "devtools", "conftest"):
        assert dev_only not in modules and not any(f"/{dev_only}/" in n for n in names)
    assert not any(n.endswith(".yaml") for n in names)  # the demo's priority.yaml stays out
    top = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert top == ["sidecar"]
