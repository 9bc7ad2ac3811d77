"""Engine outputs -> OpenAI response bodies and Server-Sent-Event chunks (completions and chat)."""
from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

from mesh.core.model.byte_level import char_bytes
from orchestrator.openai_schema import GenerationRequest
from orchestrator.stream import CompletionOutput, StreamEvent, TokenLogprob

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One Server-Sent Event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseFormatter:
    """Builds the JSON of one model's responses: token text for logprobs, ids, timestamps."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.model_name = model_name
        self._tokenizer = tokenizer
        self._token = lru_cache(maxsize=65536)(self._describe)

    def _describe(self, token_id: int) -> tuple[str, list[int] | None]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        raw = _piece_bytes(self._tokenizer, token_id)
        if "\ufffd" in text and raw is not None:  # part of a UTF-8 character: name its bytes, as vLLM does
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
        return text, list(text.encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """The text of one token as it appears in logprobs (`bytes:\\xe2\\x80` when it is not whole UTF-8)."""
        return self._token(token_id)[0]

    def token_bytes(self, token_id: int) -> list[int] | None:
        """The UTF-8 bytes of one token (its raw bytes for a partial character)."""
        return self._token(token_id)[1]

    # ---- logprobs ----------------------------------------------------------------------------
    def completion_logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...], k: int,
                            offset: int) -> dict[str, Any]:
        """Completions-style logprobs (tokens, token_logprobs, top_logprobs, text_offset) from char `offset`."""
        tokens, offsets = [], []
        for lp in lps:
            tokens.append(self.token_text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top[:k]} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...], k: int) -> dict[str, Any]:
        """Chat-style logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token_text(token_id), "logprob": logprob, "bytes": self.token_bytes(token_id)}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:k]]}
                            for lp in lps]}

    # ---- whole responses ---------------------------------------------------------------------
    def response(self, req: GenerationRequest, request_id: str, created: int,
                 outputs: list[CompletionOutput], cached_tokens: int = 0) -> dict[str, Any]:
        """The non-streaming body: choices in index order and usage."""
        choices = []
        for out in outputs:
            lps = None
            if req.top_logprobs is not None:
                lps = (self.chat_logprobs(out.logprobs, req.top_logprobs) if req.chat
                       else self.completion_logprobs(out.logprobs, req.top_logprobs, 0))
            choice: dict[str, Any] = {"index": out.index}
            if req.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice.update(logprobs=lps, finish_reason=out.finish_reason)
            if req.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        body = self._head(req, request_id, created, chunk=False)
        body["choices"] = choices
        body["usage"] = usage(len(req.prompt_ids), sum(len(o.token_ids) for o in outputs), cached_tokens)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(req.prompt_ids)
        return body

    # ---- streaming ---------------------------------------------------------------------------
    def role_chunk(self, req: GenerationRequest, request_id: str, created: int) -> dict[str, Any]:
        """The first chat chunk: every choice's assistant role (and prompt ids when asked)."""
        body = self._head(req, request_id, created, chunk=True)
        body["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(req.n)]
        return self._stream_extras(req, body, first=True)

    def event_chunk(self, req: GenerationRequest, request_id: str, created: int, ev: StreamEvent,
                    offset: int, first: bool) -> dict[str, Any]:
        """The chunk of one engine event (one choice's new tokens and text, finish_reason at its end)."""
        lps = None
        if req.top_logprobs is not None and ev.logprobs:
            lps = (self.chat_logprobs(ev.logprobs, req.top_logprobs) if req.chat
                   else self.completion_logprobs(ev.logprobs, req.top_logprobs, offset))
        choice: dict[str, Any] = {"index": ev.index}
        if req.chat:
            choice["delta"] = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
        else:
            choice["text"] = ev.text
        choice.update(logprobs=lps, finish_reason=ev.finish_reason)
        if req.return_token_ids:
            choice["token_ids"] = list(ev.token_ids)
        body = self._head(req, request_id, created, chunk=True)
        body["choices"] = [choice]
        return self._stream_extras(req, body, first)

    def usage_chunk(self, req: GenerationRequest, request_id: str, created: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last chunk before [DONE] when stream_options.include_usage: no choices, only usage."""
        body = self._head(req, request_id, created, chunk=True)
        body["choices"] = []
        body["usage"] = usage(len(req.prompt_ids), completion_tokens, cached_tokens)
        return body

    def _stream_extras(self, req: GenerationRequest, body: dict[str, Any], first: bool) -> dict[str, Any]:
        if req.include_usage:
            body["usage"] = None
        if first and req.return_token_ids:
            body["prompt_token_ids"] = list(req.prompt_ids)
        return body

    def _head(self, req: GenerationRequest, request_id: str, created: int, chunk: bool) -> dict[str, Any]:
        if req.chat:
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
        else:
            kind, prefix = "text_completion", "cmpl-"
        return {"id": prefix + request_id, "object": kind, "created": created, "model": self.model_name}


def _piece_bytes(tokenizer, token_id: int) -> list[int] | None:
    """The raw bytes of a token piece: byte-level BPE (`Ġ`-spelled) or SentencePiece byte fallback (`<0xE2>`)."""
    to_piece = getattr(tokenizer, "id_to_token", None) or getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = to_piece(token_id) if to_piece else None
    if not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    decode = char_bytes()
    if all(c in decode for c in piece):
        return [decode[c] for c in piece]
    return None


def now_s() -> int:
    """The `created` timestamp (Unix seconds)."""
    return int(time.time())
