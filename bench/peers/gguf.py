"""HF checkpoint -> GGUF with llama.cpp's own converter, cached by the checkpoint's content hash."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from .cache import LLAMACPP_VERSION, PeerCache

CONVERT_ENTRY = Path(__file__).resolve().parent / "convert_entry.py"


class ConversionError(RuntimeError):
    """The converter failed; the message carries the tail of its output."""


def checkpoint_hash(hf_dir: Path) -> str:
    """sha256 over every regular file's relative name and bytes, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(hf_dir)).encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def convert_to_gguf(
    hf_dir: str | Path,
    *,
    outtype: str = "f32",
    pre_tokenizer: str = "gpt-2",
    cache: PeerCache | None = None,
) -> Path:
    """Return a GGUF file for `hf_dir`, converting once per (content, outtype, llama.cpp version)."""
    cache = cache or PeerCache.from_env()
    cache.require("llamacpp")
    src = Path(hf_dir).resolve()
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} is not a Hugging Face checkpoint (no config.json)")
    key = f"{checkpoint_hash(src)[:24]}-{outtype}-{pre_tokenizer}-{LLAMACPP_VERSION}"
    out_dir = cache.run_dir / "gguf" / key
    target = out_dir / "model.gguf"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same checkpoint
        if target.is_file():
            return target
        fd, tmp_name = tempfile.mkstemp(dir=out_dir, suffix=".gguf.part")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            _run_converter(cache, src, tmp, outtype, pre_tokenizer)
            tmp.rename(target)  # atomic: a reader sees no file or a whole one
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _run_converter(cache: PeerCache, src: Path, out: Path, outtype: str, pre: str) -> None:
    cmd = [
        str(cache.convert_python),
        str(CONVERT_ENTRY),
        str(cache.convert_dir),
        pre,
        str(src),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_LOCAL_GGUF": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.is_file() or out.stat().st_size == 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise ConversionError(f"convert_hf_to_gguf.py failed (exit {done.returncode}):\n{tail}")
