"""The container recipe's install step (deploy/container/install.sh) run here, in a fresh
venv, on exactly the files the Containerfile copies: the light install, no torch.

It installs the dependencies from the package registry (about 30-60 s here); the image
itself is built by hand (podman), see the Containerfile's header."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deploy_files import DEPLOY, ROOT

# The install is bounded by its own INSTALL_TIMEOUT_S; the test's bound sits above it, so a
# slow pip on a busy machine ends in the install's own message, not cut off by pytest's 300 s.
INSTALL_TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)]

CONTAINERFILE = DEPLOY / "container" / "Containerfile"
INSTALL = DEPLOY / "container" / "install.sh"


def copied_source(dest: Path) -> Path:
    """The Containerfile's COPY steps into /src, done from this checkout into `dest`."""
    for line in CONTAINERFILE.read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or not words[-1].startswith("/src"):
            continue
        *sources, target = words[1:]
        matched = [p for s in sources for p in sorted(glob.glob(s, root_dir=ROOT))]
        assert matched, line
        to = dest / target.removeprefix("/src").strip("/")
        for name in matched:
            src = ROOT / name
            out = to / src.name if target.endswith("/") else to
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
    return dest


def install(venv: Path, package: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["sh", str(INSTALL), str(venv), package],
        capture_output=True,
        text=True,
        env=env,
        timeout=INSTALL_TIMEOUT_S,
    )


def test_install_script_gives_the_light_install(tmp_path: Path) -> None:
    source = copied_source(tmp_path / "src")
    venv = tmp_path / "venv"
    done = install(venv, str(source))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvfence, version" in done.stdout
    no_torch = subprocess.run(
        [venv / "bin" / "python", "-c", "import torch"], capture_output=True, text=True
    )
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    kvfence = str(venv / "bin" / "kvfence")
    listed = subprocess.run([kvfence, "--help"], capture_output=True, text=True, timeout=60)
    assert all(f"  {c} " in listed.stdout for c in ("audit", "gate", "watch")), listed.stdout
    # The incident's numbers: the gate fails (exit 1) and says by how much.
    gate = [kvfence, "gate", "--pool-tokens", "681280", "--context", "1048576"]
    failed = subprocess.run(gate, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "short by 629,440 tokens" in failed.stderr, failed
    for command in ("audit", "watch"):
        helped = subprocess.run(
            [kvfence, command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert helped.returncode == 0, helped.stdout + helped.stderr


def torch_stub_wheel(where: Path) -> Path:
    """A wheel whose only module is named torch, written as a plain zip: pip installs it with
    no build step and nothing from the package registry (the guard is what is under test)."""
    files = {
        "torch/__init__.py": "",
        "torch_stub-0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch-stub\nVersion: 0\n",
        "torch_stub-0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: kvfence-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},,\n" for name in files) + "torch_stub-0.dist-info/RECORD,,\n"
    wheel = where / "torch_stub-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in {**files, "torch_stub-0.dist-info/RECORD": record}.items():
            zf.writestr(name, text)
    return wheel


def test_install_script_refuses_an_install_that_brings_torch(tmp_path: Path) -> None:
    """The script's own guard: a package that brings a module named torch fails the build."""
    done = install(tmp_path / "venv", str(torch_stub_wheel(tmp_path)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "torch came with" in done.stderr and "not the light install" in done.stderr
