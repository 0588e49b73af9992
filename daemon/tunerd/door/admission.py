"""Prompt-length admission: count a request's prompt with the served model's tokenizer and refuse, before
it reaches vLLM, what exceeds the door's `max_prompt_tokens` (413) or what vLLM itself would refuse under
the `max_model_len` in force (400, vLLM's own wording).

What is counted (docs/door.md): `/v1/completions` and `/v1/embeddings`: each prompt (`prompt`/`input`: a
string, a list of strings, a token list, or a list of token lists) exactly as vLLM counts it
(`tokenizer.json`, special tokens added); `/v1/chat/completions`: the text of all messages' contents,
joined by newlines, without the chat template — an undercount by the template's own tokens, so the door
does not in practice refuse a chat request vLLM would accept, and vLLM still refuses the few the door
lets by.

vLLM 0.32 clamps `max_tokens` to what fits beside the prompt (`get_max_tokens`), and refuses only a
prompt longer than max_model_len or a `max_tokens` above it; the door refuses exactly those, not a sum
that vLLM would have served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["completion", "chat", "embedding"]
LIMITED: dict[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embedding",
}
DEFAULT_MAX_TOKENS: dict[Kind, int | None] = {"completion": 16, "chat": None, "embedding": None}

# What `door.no_tokenizer` says is off, and how to turn it back on when the package is what is missing:
# `scripts/install.sh --engine none` (tunerd alone, vLLM installed another way) once installed tunerd
# without `tokenizers`, which otherwise comes with vLLM, and the door lost admission quietly (issue 20).
PROMPT_CHECK_OFF = (
    "prompt-length admission is off: max_prompt_tokens is not enforced, and prompts over max_model_len "
    "reach vLLM, which refuses them itself"
)
TOKENIZERS_REMEDY = (
    "install the tokenizers package into tunerd's own environment: scripts/install.sh does (any --engine), "
    "or pip install 'vllm-tunerd[door]' there; then restart tunerd"
)


def no_tokenizer_fields(model_dir: str | Path, error: BaseException) -> dict[str, str]:
    """The fields of the `door.no_tokenizer` warning when `load_tokenizer(model_dir)` raised `error`: the
    model dir, the error, what is off and, when the `tokenizers` package is missing (ImportError), the
    remedy."""
    fields = {"model_dir": str(model_dir), "error": str(error), "off": PROMPT_CHECK_OFF}
    if isinstance(error, ImportError):
        fields["remedy"] = TOKENIZERS_REMEDY
    return fields


@dataclass(frozen=True)
class TooLong:
    """A refusal: HTTP `status`, the message naming the limit, the request field it concerns."""

    status: int
    message: str
    param: str

    def body(self) -> bytes:
        kind = "BadRequestError" if self.status == 400 else "RequestTooLarge"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return json.dumps({"error": error}).encode()


class PromptLimits:
    """The limits in force and the tokenizer to count with. Changed and read in the door's loop only;
    `load_tokenizer` may run in a worker thread (it only builds the object the loop then swaps in)."""

    def __init__(self, max_prompt_tokens: int | None) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.max_model_len: int | None = None
        self.tokenizer: Any = None  # tokenizers.Tokenizer, once loaded

    @staticmethod
    def load_tokenizer(model_dir: str | Path) -> Any:
        """The model directory's `tokenizer.json`, loaded with the `tokenizers` package (it comes with vLLM,
        and with tunerd's `door` extra for an install without one). Raises OSError / ValueError when there
        is none or it does not load, ImportError when the package is missing."""
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (prompt lengths are not checked)")
        return Tokenizer.from_file(str(path))

    def applies(self, path: str) -> Kind | None:
        """The kind of request whose length is checked on `path`, when any limit is in force."""
        kind = LIMITED.get(path)
        if kind is None or (self.max_model_len is None and self.max_prompt_tokens is None):
            return None
        return kind

    def check(self, kind: Kind, body: bytes) -> TooLong | None:
        """A refusal for this request body, or None (also for a body that is not JSON: vLLM says why)."""
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        max_len = self.max_model_len
        if kind != "embedding":
            max_tokens = _max_tokens(kind, doc)
            if max_len is not None and isinstance(max_tokens, int) and max_tokens > max_len:
                name = "max_tokens" if "max_completion_tokens" not in doc else "max_completion_tokens"
                return TooLong(
                    400,
                    f"{name}={max_tokens} cannot be greater than max_model_len={max_len}. "
                    "Please request fewer output tokens.",
                    name,
                )
        if self.tokenizer is None or doc.get("truncate_prompt_tokens") is not None:
            return None  # nothing to count with yet; or vLLM truncates the prompt itself
        counts = self._counts(kind, doc)
        if not counts:
            return None
        tokens = max(counts)
        limit = self.max_prompt_tokens
        if limit is not None and tokens > limit and (max_len is None or limit < max_len):
            return TooLong(
                413,
                f"The prompt has {tokens} tokens (counted with the model's tokenizer), over the front "
                f"door's limit of {limit} tokens (tunerd [door] max_prompt_tokens). "
                "Please reduce the length of the input prompt.",
                "max_prompt_tokens",
            )
        if max_len is not None and tokens > max_len:
            return TooLong(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                f"{tokens} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt. (max_model_len in force; refused by "
                "tunerd's front door)",
                "input_tokens",
            )
        return None

    def _counts(self, kind: Kind, doc: dict[str, Any]) -> list[int]:
        if kind == "chat":
            messages = doc.get("messages")
            if not isinstance(messages, list):
                return []
            text = "\n".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
            return [len(self.tokenizer.encode(text, add_special_tokens=False).ids)]
        prompt = doc.get("prompt" if kind == "completion" else "input")
        if isinstance(prompt, str):
            return [len(self.tokenizer.encode(prompt).ids)]
        if not isinstance(prompt, list) or not prompt:
            return []
        if all(isinstance(x, int) for x in prompt):
            return [len(prompt)]
        texts = [x for x in prompt if isinstance(x, str)]
        counts = [len(x) for x in prompt if isinstance(x, list)]
        if texts:
            counts += [len(e.ids) for e in self.tokenizer.encode_batch(texts)]
        return counts


def _max_tokens(kind: Kind, doc: dict[str, Any]) -> Any:
    if kind == "chat":
        value = doc.get("max_completion_tokens")
        return value if value is not None else doc.get("max_tokens")
    return doc.get("max_tokens", DEFAULT_MAX_TOKENS[kind])


def _content_text(content: Any) -> str:
    """A chat message's text: the string, or the `text` of its text parts (images etc. not counted)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""
