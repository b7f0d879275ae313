"""Tokenizer: the `tokenizers` library plus the checkpoint's Jinja chat template, without importing transformers
(which would add seconds to every boot). Behaves like transformers' fast tokenizer for encode, decode and
apply_chat_template(tokenize=False)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from warmstart.errors import UserError, reading


_GIL_FREE_CHARS = 64 * 1024


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{model_dir} has no tokenizer.json. warmstart needs a fast tokenizer; save one with "
                            "transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder).")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises bare Exceptions for corrupt files
            raise UserError(f"{path} could not be read ({e}). The tokenizer file is corrupt.") from None
        cfg_path = model_dir / "tokenizer_config.json"
        with reading(cfg_path, "tokenizer config", "The file is corrupt; restore tokenizer_config.json from the "
                                                   "original checkpoint."):
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            if not isinstance(cfg, dict):
                raise ValueError(f"expected a JSON object, got a {type(cfg).__name__}")
            template = cfg.get("chat_template")
            jinja_path = model_dir / "chat_template.jinja"
            if template is None and jinja_path.is_file():
                template = jinja_path.read_text()
            if isinstance(template, list):       # named templates: use "default"
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if template is not None and not isinstance(template, str):
                raise ValueError(f"chat_template must be a string, got a {type(template).__name__}")
            self.chat_template: str | None = template
            self.bos_token = _token_text(cfg.get("bos_token"))
            self.eos_token = _token_text(cfg.get("eos_token"))
            for name in ("bos_token", "eos_token"):
                if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                    raise ValueError(f"{name} must be a string or {{'content': str}}")
            self._special = dict(cfg.get("added_tokens_decoder") or {})

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text, for libraries that build their own view of the vocabulary (llguidance)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # tokenizers' encode holds the GIL for the whole call (10 s for 10 MB); encode_batch releases it, so a
            # server thread tokenizing a huge prompt does not stall the event loop. Same ids either way.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            **template_kwargs) -> str:
        """As transformers renders it. template_kwargs reach the template as variables (e.g. Qwen3's
        enable_thinking); continue_final_message leaves the last (assistant) message open for the model to go on."""
        if not self.chat_template:
            raise UserError("This model has no chat template, so chat requests cannot be formatted. Use "
                            "completions with a plain prompt, or a model whose tokenizer_config.json has one.")
        variables = {**template_kwargs, "messages": messages, "tools": tools or None,
                     "add_generation_prompt": add_generation_prompt and not continue_final_message,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        text = _compile(self.chat_template).render(**variables)
        if continue_final_message:
            # transformers' rule: cut right after the final message's content (stripped), dropping its end marker.
            final = (messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise UserError("continue_final_message: the final message's content is not in the rendered "
                                "template, so it cannot be continued.")
            text = text[:at + len(final)]
        return text

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        # Templates write the BOS themselves; adding special tokens again would double it (as transformers avoids).
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


_cache: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _cache:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _cache[source] = env.from_string(source)
    return _cache[source]
