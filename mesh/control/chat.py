"""`mesh chat`: a conversation with a running `mesh up` in the terminal, as `ollama run` offers.

Each line read is a user turn; the reply streams from /v1/chat/completions as it is generated and
joins the conversation, so the model sees every earlier turn (and the `--system` message first).
End of input (Ctrl-D) or Ctrl-C at the prompt ends the session; Ctrl-C during a reply stops that
reply and keeps what had arrived.
"""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """Where the server is and how to sample each reply."""

    url: str  # the orchestrator's base URL, e.g. http://127.0.0.1:8000
    system: str | None = None  # the system message that opens the conversation
    api_key: str | None = None  # sent as a Bearer token when the server wants one
    max_tokens: int = 512  # the longest reply
    temperature: float = 0.0  # 0: greedy
    timeout_s: float = 600.0  # one reply's HTTP deadline

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url: expected http(s)://HOST:PORT, got {self.url!r}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")


def stream_reply(settings: ChatSettings, messages: list[dict[str, str]], out: TextIO) -> tuple[str, str | None]:
    """POST the conversation with stream=true, write each piece of the reply to `out` as it arrives.

    Returns (the reply's text, its finish_reason). Ctrl-C stops the reply early (finish_reason None).
    """
    body = {"messages": messages, "stream": True, "max_tokens": settings.max_tokens,
            "temperature": settings.temperature}
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    req = urllib.request.Request(f"{settings.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers, method="POST")
    pieces: list[str] = []
    reason = None
    try:
        with urllib.request.urlopen(req, timeout=settings.timeout_s) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or ""
                    pieces.append(text)
                    out.write(text)
                    out.flush()
                    reason = choice.get("finish_reason") or reason
    except KeyboardInterrupt:
        out.write(" [stopped]")
    except urllib.error.HTTPError as e:
        raise ValueError(f"/v1/chat/completions: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach the orchestrator at {settings.url}: {e.reason}") from None
    out.write("\n")
    out.flush()
    return "".join(pieces), reason


def chat_loop(settings: ChatSettings, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """Read user turns from `inp` until end of input, streaming each reply to `out`; returns the exit code."""
    messages = [{"role": "system", "content": settings.system}] if settings.system else []
    prompt = ">>> " if inp.isatty() else ""
    while True:
        try:
            out.write(prompt)
            out.flush()
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:  # end of input
            if prompt:
                out.write("\n")
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply, _ = stream_reply(settings, messages, out)
        messages.append({"role": "assistant", "content": reply})
