"""The model's tokenizer (tokenizer.json) and chat template (tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import ModelError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer


class ChatTemplateError(ValueError):
    """A request's messages could not be rendered by the model's chat template."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json holds special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and render chat messages the way Hugging Face tokenizers do.

    Example::

        tok = Tokenizer(Path("tiny-llama"))
        ids = tok.encode("Hello")                     # starts with <s> for a Llama tokenizer
        prompt = tok.render_chat([{"role": "user", "content": "Hi"}])
        ids = tok.encode(prompt, add_special_tokens=False)
    """

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        path = directory / "tokenizer.json"
        try:
            self._tok = HfTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelError(f"{path}: cannot load the tokenizer: {e}") from e
        cfg_path = directory / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except ValueError as e:
            raise ModelError(f"{cfg_path}: not valid JSON: {e}") from e
        self.bos_token = _token_text(cfg.get("bos_token")) or ""
        self.eos_token = _token_text(cfg.get("eos_token")) or ""
        self.chat_template: str | None = cfg.get("chat_template")
        self._template: Any = None

    @property
    def backend(self) -> HfTokenizer:
        """The `tokenizers.Tokenizer` itself, for its DecodeStream (see detok.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages`, through the model's Jinja chat template."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ChatTemplateError("this model has no chat_template in tokenizer_config.json")
        if self._template is None:
            # Sandboxed like transformers: a template is data from the model directory.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatTemplateError(f"chat template: {e}") from e


def _raise(message: str) -> None:
    raise ChatTemplateError(message)
