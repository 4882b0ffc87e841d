"""DeepSeek-V4's DSML tool calls (`deepseek_v4` in strata.server.tools.calls): parsed whole and streamed in every split,
calls rendered by the V4 chat encoding parse back to themselves, malformed blocks are text, and the format is
found from the encoding's rendering and from the model type."""

from __future__ import annotations

import json

import pytest

from strata.runtime.generation.text.chat_dsv4 import render_chat
from strata.server.tools.calls import TOOL_FORMATS, CallParsing, Delta, parse_output, tool_format

FMT = TOOL_FORMATS["deepseek_v4"]
D = "｜DSML｜"
OUTPUT = (f'Let me look.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
          f'<{D}parameter name="city" string="true">São Paulo "centro"</{D}parameter>\n'
          f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
          f'<{D}parameter name="opts" string="false">{{"units": ["C", "F"], "raw": null}}</{D}parameter>\n'
          f'</{D}invoke>\n<{D}invoke name="get_time">\n\n</{D}invoke>\n</{D}tool_calls>')
CALLS = [("get_weather", {"city": 'São Paulo "centro"', "days": 3, "opts": {"units": ["C", "F"], "raw": None}}),
         ("get_time", {})]


def _calls(d: Delta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in d.calls]


def _streamed(text: str, cuts: list[int]) -> Delta:
    stream, out, last = FMT.stream(), Delta(), 0
    for cut in [*cuts, len(text)]:
        out += stream.feed(text[last:cut])
        last = cut
    out += stream.flush()
    return out


def test_dsml_parses_whole_and_in_every_split():
    whole = parse_output(FMT, OUTPUT)
    assert (whole.content, _calls(whole)) == ("Let me look.", CALLS)
    assert all(isinstance(c.arguments, str) for c in whole.calls)
    for i in range(1, len(OUTPUT)):  # every single cut, and every pair of cuts around the markers
        d = _streamed(OUTPUT, [i])
        assert (d.content, _calls(d)) == ("Let me look.", CALLS), i
    for i in range(0, len(OUTPUT), 7):
        for j in range(i + 1, min(len(OUTPUT), i + 40)):
            d = _streamed(OUTPUT, [i, j])
            assert (d.content, _calls(d)) == ("Let me look.", CALLS), (i, j)


def test_one_character_deltas_give_text_before_the_call_completes():
    stream, got = FMT.stream(), []
    for ch in OUTPUT:
        got.append(stream.feed(ch))
    got.append(stream.flush())
    text_done = next(i for i, d in enumerate(got) if d.content)
    call_done = next(i for i, d in enumerate(got) if d.calls)
    assert text_done < OUTPUT.index("<" + D) < call_done
    assert "".join(d.content for d in got) == "Let me look."


@pytest.mark.parametrize("text", [
    f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">{{bad</{D}parameter>\n'
    f'</{D}invoke>\n</{D}tool_calls>',  # string="false" that is not JSON
    f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="true">1</{D}parameter>\n'
    f'<{D}parameter name="n" string="true">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',  # repeated parameter
    f'<{D}tool_calls>\nstray text<{D}invoke name="f">\n</{D}invoke>\n</{D}tool_calls>',  # text between invokes
    f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="true">1',  # cut off mid-call
    f'<{D}tool_calls>\n</{D}tool_calls>',  # no call at all
])
def test_a_block_that_does_not_parse_is_text(text):
    out = parse_output(FMT, "Hi " + text)
    assert out.calls == [] and out.content == "Hi " + text


def test_calls_rendered_by_the_v4_encoding_parse_back():
    """Round trip: an assistant turn's calls, rendered by the encoding, parse back to the same calls."""
    args = [{"city": "Zürich", "days": 2, "flags": [True, None], "nested": {"a": "<b>"}}, {}, {"q": "1 < 2 && \n"}]
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": f"fn{i}", "arguments": json.dumps(a)}}
             for i, a in enumerate(args)]
    prompt = render_chat([{"role": "user", "content": "go"}, {"role": "assistant", "content": "Sure.",
                                                               "tool_calls": calls}], enable_thinking=False)
    reply = prompt[prompt.index("</think>") + len("</think>"):prompt.rindex("<｜end▁of▁sentence｜>")]
    parsed = parse_output(FMT, reply)
    assert parsed.content == "Sure."
    assert _calls(parsed) == [(f"fn{i}", a) for i, a in enumerate(args)]


def test_forced_prefix_leads_into_a_call():
    for name, rest in (("get_time", f'\n</{D}invoke>\n</{D}tool_calls>'),
                       (None, f'get_time">\n</{D}invoke>\n</{D}tool_calls>')):
        prefix = FMT.forced_prefix(name)
        assert prefix.startswith(f"\n\n<{D}tool_calls>\n<{D}invoke name=\"")
        parsing = CallParsing(FMT, (), prefix)
        out = parse_output(parsing.fmt, parsing.prefix + rest)
        assert (out.content, _calls(out)) == ("", [("get_time", {})])


def test_the_format_is_found_from_the_rendering_and_the_model_type():
    call = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rendered = render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]}])
    assert tool_format("qwen3_moe", None, template_call=rendered).name == "deepseek_v4"
    assert tool_format("deepseek_v4", None).name == "deepseek_v4"
    assert tool_format("deepseek_v3", None).name == "deepseek"  # V3's own format is untouched
