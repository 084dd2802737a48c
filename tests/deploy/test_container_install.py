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
from pathlib import Path

import pytest
from deploy_files import DEPLOY, ROOT

pytestmark = pytest.mark.slow

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
        timeout=600,
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


def test_install_script_refuses_an_install_that_brings_torch(tmp_path: Path) -> None:
    """The script's own guard: a package that brings a module named torch fails the build."""
    stub = tmp_path / "torch-stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text("")
    (stub / "pyproject.toml").write_text(
        '[project]\nname = "torch-stub"\nversion = "0"\n'
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    done = install(tmp_path / "venv", str(stub))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "torch came with" in done.stderr and "not the light install" in done.stderr
