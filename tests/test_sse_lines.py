"""A server-sent event's data is one line to any client: generated text may hold characters that
line readers split on (httpx's `iter_lines` and Python's `str.splitlines` split on NEL, LINE and
PARAGRAPH SEPARATOR as well as on CR and LF), and a random model once wrote one into a streamed
tool call's arguments, cutting the event in two. Every emitter escapes them; the JSON reads back
to the same text."""
import itertools
import json

import pytest

from kvfold.server import anthropic_format, openai_responses, responses
from kvfold.server.formats import sse_json

# every character str.splitlines splits on
BREAKS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("ch", BREAKS)
def test_sse_json_is_one_line_and_reads_back(ch):
    obj = {"delta": f"a{ch}b é 中"}
    line = sse_json(obj)
    assert line.splitlines() == [line] and json.loads(line) == obj
    assert "é 中" in line  # other text stays UTF-8, not escaped


@pytest.mark.parametrize("ch", BREAKS)
def test_every_streaming_emitter_writes_its_data_on_one_line(ch):
    text = f"x{ch}y"
    frames = [responses.event({"text": text}), anthropic_format.event("delta", {"text": text}),
              openai_responses._sse({"type": "response.output_text.delta", "delta": text}, itertools.count())]
    for frame in frames:
        lines = frame.splitlines()
        data = [ln for ln in lines if ln.startswith("data: ")]
        assert len(data) == 1 and all(ln.startswith(("data: ", "event: ")) or ln == "" for ln in lines)
        assert text in json.loads(data[0][len("data: "):]).values()
