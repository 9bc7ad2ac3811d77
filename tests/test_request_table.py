"""orchestrator/request_table.py: the engine's live requests, their streams and their sequences' owners."""
from __future__ import annotations

from orchestrator.request_table import RequestTable
from orchestrator.scheduler_types import TokenEvent
from orchestrator.stream import RequestStream, TextTracker


class _Letters:
    """A tokenizer whose token i is the letter chr(96 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def _token(seq_id, request_id, token_id, finish_reason=None):
    return TokenEvent(seq_id, request_id, token_id, None, (), finish_reason)


def _open(table, request_id, n, stop=()):
    stream = RequestStream(request_id, n, None)
    table.open(request_id, stream, [TextTracker(_Letters(), stop) for _ in range(n)])
    return stream, [table.new_sequence(request_id, i) for i in range(n)]


def test_tokens_stream_to_their_choice_and_a_request_ends_with_its_last_sequence():
    table = RequestTable()
    stream, (s0, s1) = _open(table, "r1", 2, stop=("cd",))
    table.scheduled(s0, 5, 1.0)
    table.scheduled(s1, 7, 2.0)  # a later choice's admission changes neither
    assert (stream.scheduled_at, stream.cached_tokens) == (1.0, 5)
    assert table.push_token(_token(s0, "r1", 1)) is None
    assert table.push_token(_token(s0, "r1", 2)) is None
    assert table.push_token(_token(s0, "r1", 3)) is None
    assert table.push_token(_token(s0, "r1", 4)) == "stop"  # the stop string "cd" met: the text ends before it
    assert table.forget(s0) is False and "r1" in table  # its other choice is still open
    assert table.push_token(_token(s1, "r1", 5, "length")) == "length"
    assert table.forget(s1) is True and "r1" not in table and not table
    out = stream.result(timeout=1)
    assert (out[0].token_ids, out[0].text, out[0].finish_reason) == ([1, 2, 3, 4], "ab", "stop")
    assert (out[1].text, out[1].finish_reason) == ("e", "length")
    assert table.push_token(_token(s1, "r1", 6)) is None and not table.owns(s1)  # no longer live: ignored


def test_cancel_end_and_drop():
    table = RequestTable()
    stream, (s0, s1) = _open(table, "r1", 2)
    other, (s2,) = _open(table, "r2", 1)
    assert table.seq_ids() == [s0, s1, s2] and table.request_ids() == ["r1", "r2"]
    table.end(s0, "error", "station failed")
    assert table.forget(s0) is False
    assert table.cancel("r1") is True and table.cancel("r1") is False
    out = stream.result(timeout=1)
    assert [(o.finish_reason, o.error) for o in out] == [("error", "station failed"), ("cancelled", None)]
    assert table.seq_ids() == [s2]
    _, (s3,) = _open(table, "r3", 1)
    table.drop("r3")  # not admitted after all: gone with its sequence
    assert "r3" not in table and not table.owns(s3) and table.request_ids() == ["r2"]
    assert s3 > s2  # sequence ids are never reused
    assert not other.done
