"""Tokenizer: `tokenizer.json` through the `tokenizers` library, plus the chat template.

Encoding adds no special tokens unless asked (a prompt is exactly its text).
Streaming detokenization never emits half a UTF-8 character: text is released
only once the bytes decoded so far end on a character boundary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

_REPLACEMENT = "\ufffd"


def _token_content(value: Any) -> str | None:
    """`tokenizer_config.json` stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A Jinja chat template rendered in a sandbox, as `transformers` does."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        # Jinja is imported on the first chat request, not at start-up: every role that
        # loads a tokenizer (the router, the single-process server) starts sooner.
        import jinja2
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        template = env.from_string(self.source)
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )


@dataclass(slots=True)
class Tokenizer:
    """A loaded tokenizer: encode/decode, special ids, optional chat template."""

    backend: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: ChatTemplate | None = None
    extra_eos_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_dir(cls, directory: str | Path, *, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"missing tokenizer.json in {directory}")
        backend = HFTokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        bos = _token_content(config.get("bos_token"))
        eos = _token_content(config.get("eos_token"))
        template_src = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template_src is None and template_file.is_file():
            template_src = template_file.read_text(encoding="utf-8")
        if isinstance(template_src, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template_src}
            template_src = named.get("default")
        template = (
            ChatTemplate(str(template_src), bos_token=bos or "", eos_token=eos or "")
            if template_src
            else None
        )
        return cls(
            backend=backend,
            bos_token=bos,
            eos_token=eos,
            chat_template=template,
            extra_eos_ids=extra_eos_ids,
        )

    # ---- ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (may be fewer than the model's embedding rows)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos plus the model config's."""
        ids = [] if self.eos_id is None else [self.eos_id]
        ids += [i for i in self.extra_eos_ids if i not in ids]
        return tuple(ids)

    # ---- text -------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json)")
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )

    def detokenizer(self, *, skip_special_tokens: bool = True) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)


class StreamingDetokenizer:
    """Turns ids arriving one at a time into text pieces whose concatenation is the full decode.

    Keeps two offsets into the ids (both on character boundaries): text before
    `prefix` is emitted and settled; ids[prefix:read] were decoded last time.
    Each step decodes ids[prefix:] and emits only the part after ids[prefix:read]'s
    text, and only when it does not end inside a character (a trailing U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the new text that is now complete (maybe "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is left, replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]
