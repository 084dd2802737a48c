"""Run llama.cpp's convert_hf_to_gguf.py, naming the BPE pre-tokenizer when it does not know it.

Runs inside the llama.cpp venv (not the project's): python convert_entry.py CONVERT_DIR PRE ARGS...
The converter recognises a pre-tokenizer by hashing how it splits a fixed text; a fresh
byte-level BPE with the GPT-2 regex hashes to nothing it knows, and naming it `gpt-2` is
exactly right for that regex (PEERS.md). Known tokenizers keep the converter's own answer.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    convert_dir, pre, *args = sys.argv[1:]
    sys.path[:0] = [convert_dir, str(Path(convert_dir) / "gguf-py")]
    from conversion import base  # llama.cpp tree, on sys.path only inside its venv

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return str(known(self, tokenizer))
        except NotImplementedError:
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(Path(convert_dir) / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
