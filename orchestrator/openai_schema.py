"""OpenAI request bodies -> GenerationRequest, with a 400 naming the field for anything wrong.

Plain dict parsing (no pydantic): every check raises ApiError(status, message, param), which
api.py turns into OpenAI's `{"error": {message, type, param, code}}` body. Nothing here
touches the engine; the scheduler's admission (context length, queue) happens after.
Text longer than the context could hold (`max_prompt_bytes`) is refused before the chat template
or the tokenizer sees it; parsing is CPU work, which generation_routes.py runs off the event loop.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mesh.core.config import ModelConfig, is_int
from mesh.core.params import MAX_LOGPROBS, ParamError, SamplingParams

# fields that would change the result if honoured; refused rather than silently ignored
_UNSUPPORTED = {"echo": (False, None), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "tools": (None, []), "response_format": (None, {"type": "text"})}
_ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: status, message, the offending `param`, a machine `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        """OpenAI's error `type` for this status."""
        return {401: "invalid_request_error", 404: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, ready for engine.submit."""

    chat: bool  # chat.completion shape (else text_completion)
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    return_token_ids: bool  # each choice's token_ids and the top-level prompt_token_ids
    top_logprobs: int | None  # None: no logprobs; k: the sampled token's logprob and k alternatives


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


def _opt_int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad(name, f"must be an integer {rng}, got {v!r}")
    return v


def _opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


class RequestParser:
    """Validates request bodies against one model: its name, vocabulary, chat template and `max_n`, and the
    context the route serves now (`context()`: the engine's max_context, which a small KV pool can make shorter
    than the model's; a chat without max_tokens may fill it, as in OpenAI's API)."""

    def __init__(self, tokenizer, chat_template: str | None, model_name: str, model: ModelConfig, max_n: int,
                 context: Callable[[], int] | None = None) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name
        self.vocab_size, self.max_context, self.max_n = model.vocab_size, model.max_position_embeddings, max_n
        self._context = context or (lambda: model.max_position_embeddings)
        self.token_bytes = longest_token_bytes(tokenizer)
        self.max_prompt_bytes = self.max_context * self.token_bytes  # more text than this is more tokens than the context
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        self.template = env.from_string(chat_template) if chat_template else None
        eos = model.eos_token_ids[0] if model.eos_token_ids else None
        self._specials = {"bos_token": _token_text(tokenizer, model.bos_token_id),
                          "eos_token": _token_text(tokenizer, eos)}

    def completion(self, body: Any) -> GenerationRequest:
        """Parse a /v1/completions body (prompt: string or token ids)."""
        body = self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise bad("prompt", "is empty: at least one token is required")
            self._check_bytes("prompt", len(prompt.encode("utf-8")))
            ids = self.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list):
            if not prompt:
                raise bad("prompt", "is empty: at least one token is required")
            if len(prompt) > (context := self._context()):
                raise bad("prompt", f"{len(prompt)} tokens exceed the context of {context} tokens",
                          "context_length_exceeded")
            if not all(is_int(t) for t in prompt):
                raise bad("prompt", "must be a string or a list of token ids (batched prompts are not supported)")
            ids = prompt
        else:
            raise bad("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        self._check_ids("prompt", ids)
        lp = _opt_int(body, "logprobs", 0, MAX_LOGPROBS)
        return self._finish(body, ids, chat=False, top_logprobs=lp, default_max=16)

    def chat(self, body: Any) -> GenerationRequest:
        """Parse a /v1/chat/completions body: messages rendered with the chat template."""
        body = self._common(body)
        if self.template is None:
            raise bad("messages", "this model has no chat template; use /v1/completions", "no_chat_template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of {role, content} objects")
        if len(messages) > self.max_context:  # a chat template spends at least one token on each message
            raise bad("messages", f"{len(messages)} messages cannot fit the context of {self.max_context} tokens",
                      "context_length_exceeded")
        rendered = [self._message(i, m) for i, m in enumerate(messages)]
        self._check_bytes("messages", sum(len(m["content"].encode("utf-8")) for m in rendered))
        try:
            text = self.template.render(messages=rendered, add_generation_prompt=True, **self._specials)
        except Exception as err:  # a TemplateError, or a template tripping over odd input: a 400
            raise bad("messages", f"the chat template refused them: {type(err).__name__}: {err}") from err
        self._check_bytes("messages", len(text.encode("utf-8")), " rendered with the chat template")
        ids = self.encode(text, add_special_tokens=False)
        if not ids:
            raise bad("messages", "rendered to an empty prompt")
        want = _opt_bool(body, "logprobs")
        top = _opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise bad("top_logprobs", "requires logprobs: true")
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        return self._finish(body, ids, chat=True, top_logprobs=(top or 0) if want else None,
                            default_max=max(1, self._context() - len(ids)))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (a `tokenizers.Tokenizer` or a transformers tokenizer)."""
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is not None:  # tokenizers.Tokenizer: its batch call lets go of the GIL while it works, encode() does not
            return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)
        out = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(getattr(out, "ids", out))

    def _check_bytes(self, param: str, size: int, what: str = "") -> None:
        """400 when `size` bytes of text are more than the context's tokens could ever spell."""
        if size > self.max_prompt_bytes:
            raise bad(param, f"{size} bytes of text{what} cannot fit the context of {self.max_context} tokens: "
                             f"the limit is {self.max_prompt_bytes} bytes (no token of this tokenizer spells more "
                             f"than {self.token_bytes} bytes)", "context_length_exceeded")

    # ---- helpers ---------------------------------------------------------------------------
    def _common(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"must be a string, got {type(model).__name__}")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model", "model_not_found")
        for name, allowed in _UNSUPPORTED.items():
            if name in body and body[name] not in allowed:
                raise bad(name, "is not supported by this server", "unsupported_parameter")
        return body

    def _message(self, i: int, m: Any) -> dict:
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", "only {type: text, text: string} parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"must be a string or a list of text parts, got {type(content).__name__}")
        out = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out

    def _check_ids(self, name: str, ids) -> None:
        for t in ids:
            if not (is_int(t) and 0 <= t < self.vocab_size):
                raise bad(name, f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")

    def _finish(self, body: dict, ids: list[int], chat: bool, top_logprobs: int | None,
                default_max: int) -> GenerationRequest:
        n = _opt_int(body, "n", 1) or 1
        if n > self.max_n:
            raise bad("n", f"must be at most {self.max_n}, got {n}")
        stream = bool(_opt_bool(body, "stream"))
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise bad("stream_options", "is only allowed with stream: true")
            if not isinstance(options, dict):
                raise bad("stream_options", "must be an object")
        include_usage = bool(_opt_bool(options or {}, "include_usage"))
        return_ids = bool(_opt_bool(body, "return_token_ids"))
        params = self._sampling(body, default_max, 0 if top_logprobs is None else max(1, top_logprobs))
        return GenerationRequest(chat, tuple(ids), params, n, stream, include_usage, return_ids, top_logprobs)

    def _sampling(self, body: dict, default_max: int, logprobs: int) -> SamplingParams:
        kw: dict[str, Any] = {"max_tokens": default_max, "logprobs": logprobs, "seed": secrets.randbelow(2**63)}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"):
            v = body.get(name)
            if v is None:
                continue
            if name in ("max_tokens", "top_k", "seed") and isinstance(v, float) and v.is_integer():
                v = int(v)
            if name in ("temperature", "top_p") and isinstance(v, float) and not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
            kw[name] = v
        if is_int(kw.get("top_k")) and kw["top_k"] == -1:
            kw["top_k"] = 0  # vLLM's spelling of "all tokens"
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
            kw["stop"] = tuple(stop)
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None:
            if not isinstance(stop_ids, list):
                raise bad("stop_token_ids", "must be a list of token ids")
            self._check_ids("stop_token_ids", stop_ids)
            kw["stop_token_ids"] = tuple(stop_ids)
        try:
            return SamplingParams(**kw)
        except ParamError as err:
            raise bad(err.param, str(err).split(": ", 1)[-1]) from err


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocabulary entry as the
    tokenizer spells it (byte-level and sentencepiece spellings are never shorter than their text), at least
    one UTF-8 character. It holds for normalizers that do not drop characters, as the Llama family's."""
    return max(4, max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=4))


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _token_text(tokenizer, token_id: int | None) -> str:
    """The text of a special token for the chat template ("" when unknown)."""
    if token_id is None:
        return ""
    convert = getattr(tokenizer, "id_to_token", None) or tokenizer.convert_ids_to_tokens
    return convert(token_id) or ""
