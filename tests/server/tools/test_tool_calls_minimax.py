"""MiniMax-M2's tool calls (`minimax_m2`): `<invoke name="NAME">` elements of `<parameter name="K">V</parameter>` in
`<minimax:tool_call>` blocks, parsed whole and streamed in every split, values typed by the tools' schemas; calls
that MiniMax-M2's chat template writes parse back to the calls it renders; malformed blocks are text; the format
is chosen from the template, the vocabulary or the model type."""

from __future__ import annotations

import random

import pytest
from test_tool_calls import TOOLS, _calls, _streamed, _tokenizer

from strata.runtime.generation.text.tokenizer import _compile_template
from strata.server.tools.calls import TOOL_FORMATS, parse_output, tool_format
from strata.server.tools.request import template_tool_calls

FMT = "minimax_m2"
# (model output, content, [(name, arguments)])
OUTPUTS = [
    ('Let me check both.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San Francisco'
     '</parameter>\n<parameter name="days">3</parameter>\n<parameter name="units">10</parameter>\n</invoke>\n'
     '<invoke name="get_time">\n<parameter name="tz">CET</parameter>\n</invoke>\n</minimax:tool_call>',
     "Let me check both.", [("get_weather", {"city": "San Francisco", "days": 3, "units": "10"}),
                            ("get_time", {"tz": "CET"})]),  # days typed by the schema, units kept as text
    ('<minimax:tool_call>\n<invoke name=get_weather><parameter name="city">\nZürich\n</parameter>'
     '<parameter name="extra">{"wind": true, "hours": [6, 12]}</parameter></invoke>\n</minimax:tool_call>',
     "", [("get_weather", {"city": "Zürich", "extra": {"wind": True, "hours": [6, 12]}})]),  # unquoted name, JSON
    ('<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>', "", [("get_time", {})]),
    ("No tools needed: 2 < 3, <invoke> is a word here.", "No tools needed: 2 < 3, <invoke> is a word here.", []),
]
MALFORMED = [
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Pa',  # cut off by max_tokens
    '<minimax:tool_call>\nget_weather(city="Paris")\n</minimax:tool_call>',  # no invoke
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris\n</invoke>\n</minimax:tool_call>',
    '<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>',
]

# MiniMax-M2's chat template, the part that writes an assistant turn's calls (as its release ships it)
TEMPLATE = (
    "{%- for message in messages -%}{%- if message.tool_calls -%}\n"
    "{{- '\\n' ~ '<minimax:tool_call>' ~ '\\n' }}\n"
    "{%- for tool_call in message.tool_calls -%}\n"
    "    {%- if tool_call.function %}\n        {%- set tool_call = tool_call.function %}\n    {%- endif %}\n"
    "    {{- '<invoke name=\"' + tool_call.name + '\">' }}\n"
    "    {% set _args = tool_call.arguments %}\n"
    "    {%- for k, v in _args.items() %}\n"
    "    {{- '<parameter name=\"' + k + '\">' }}\n"
    "    {{- v | tojson(ensure_ascii=False) if v is not string else v }}\n"
    "    {{- '</parameter>' }}\n"
    "    {% endfor %}\n"
    "    {{- '</invoke>' ~ '\\n' }}\n"
    "{%- endfor -%}\n"
    "{{- '</minimax:tool_call>' }}\n"
    "{%- endif -%}{%- endfor -%}"
)


@pytest.mark.parametrize(("text", "content", "calls"), OUTPUTS)
def test_parses_whole_and_in_every_split(text, content, calls):
    whole = parse_output(TOOL_FORMATS[FMT], text, TOOLS)
    assert (whole.content, whole.reasoning, _calls(whole)) == (content, "", calls)
    assert len({c.id for c in whole.calls}) == len(calls)
    rng = random.Random(7)
    splits = [list(range(1, len(text))), [len(text) // 2]] + [sorted(rng.sample(range(1, len(text)), 12))
                                                              for _ in range(20)]
    for cuts in splits:  # one character at a time, halves, random pieces: the same answer
        got = _streamed(FMT, text, cuts)
        assert (got.content, got.reasoning, _calls(got)) == (content, "", calls), cuts


@pytest.mark.parametrize("text", MALFORMED)
def test_a_block_that_does_not_parse_is_text(text):
    got = parse_output(TOOL_FORMATS[FMT], text, TOOLS)
    assert got.calls == [] and got.content == text
    assert _streamed(FMT, text, list(range(1, len(text)))).content == text


def test_text_streams_out_before_a_call_completes():
    stream = TOOL_FORMATS[FMT].stream(TOOLS)
    assert stream.feed("Checking.\n<minimax:tool").content == "Checking."  # the tail that could begin a call waits
    d = stream.feed('_call>\n<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n</invoke>\n')
    assert d.content == "" and d.calls == []  # no call until the block's end marker
    assert _calls(stream.feed("</minimax:tool_call>")) == [("get_time", {"tz": "UTC"})]
    assert stream.flush().content == ""


def test_forced_prefixes_lead_the_model_into_a_call():
    fmt = TOOL_FORMATS[FMT]
    rest = '<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>'
    for prefix, after in ((fmt.forced_prefix("get_weather"), rest), (fmt.forced_prefix(None), 'get_weather">\n' + rest)):
        assert _calls(parse_output(fmt, prefix + after, TOOLS)) == [("get_weather", {"city": "Rome"})]


def test_the_format_comes_from_the_template_the_vocabulary_then_the_model_type():
    assert tool_format("minimax_m2", _tokenizer(["<minimax:tool_call>", "</minimax:tool_call>"])).name == FMT
    assert tool_format("qwen3_moe", _tokenizer(["<minimax:tool_call>"])).name == FMT  # the vocabulary wins
    assert tool_format("minimax_m2", _tokenizer([])).name == FMT and tool_format("minimax_m2", None).name == FMT
    rendered = '<think>\nok\n</think>\n\n<minimax:tool_call>\n<invoke name="f">\n</invoke>\n</minimax:tool_call>'
    assert tool_format("qwen3_moe", _tokenizer(["<tool_call>"]), template_call=rendered).name == FMT
    assert tool_format("minimax_m2", _tokenizer([]), "hermes").name == "hermes"  # --tool-call-parser


def test_calls_rendered_by_its_template_parse_back():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Zürich", "days": 2}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    messages = [{"role": "assistant", "content": "", "tool_calls": template_tool_calls(calls, "messages.0.tool_calls")}]
    text = _compile_template(TEMPLATE).render(messages=messages)
    assert '<invoke name="get_weather">\n<parameter name="city">Zürich</parameter>\n<parameter name="days">2' in text
    assert _calls(parse_output(TOOL_FORMATS[FMT], text, TOOLS)) == [("get_weather", {"city": "Zürich", "days": 2}),
                                                                    ("get_time", {"tz": "UTC"})]


# the release's chat template, shortened to what tools touch: the tools in the system turn, an assistant turn's calls,
# the tool's responses, the generation prompt opening the thinking block
CHAT_TEMPLATE = (
    "]~!b[]~b]system\nYou are a helpful assistant.{% if tools %}\n\n# Tools\n<tools>\n{% for tool in tools %}"
    "<tool>{{ tool.function | tojson(ensure_ascii=False) }}</tool>\n{% endfor %}</tools>{% endif %}[e~[\n"
    "{%- for message in messages -%}{%- if message.role == 'assistant' -%}{{- ']~b]ai' ~ '\\n' }}"
    "{%- if message.content %}{{- message.content }}{% endif %}"
    + TEMPLATE.replace("{%- for message in messages -%}", "").replace("{%- endif -%}{%- endfor -%}", "{%- endif -%}")
    + "{{- '[e~[' ~ '\\n' }}{%- elif message.role == 'tool' -%}{{- ']~b]tool\\n<response>' ~ message.content ~ "
    "'</response>[e~[\\n' }}{%- else -%}{{- ']~b]' ~ message.role ~ '\\n' ~ message.content ~ '[e~[\\n' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{- ']~b]ai\\n<think>\\n' }}{%- endif -%}"
)


def test_the_server_picks_the_format_from_minimax_m2s_template(tmp_path):
    """A MiniMax-M2 checkpoint's template writes the tools and past calls into the prompt; the server reads calls in
    the minimax_m2 format, and a named tool_choice appends the start of that call (this word-level vocabulary has no
    <think> token, so the thinking block the generation prompt opens does not hold the call back)."""
    import asyncio

    from minimax_m2_models import build_minimax_m2_reference

    from strata import Engine
    from strata.server.app import ServerState
    from strata.server.chat import render_chat, template_tool_messages
    from strata.server.tools.request import check_tool_choice

    _, directory = build_minimax_m2_reference(tmp_path / "m2")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    engine = Engine.from_pretrained(directory, device="cpu", config={"runtime": {"dtype": "float32", "experts": "memory"}})
    st = ServerState("m2", engine, scheduler=object())
    assert st.tool_format.name == FMT and st.template_renders_tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    messages = template_tool_messages([{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "",
                                        "tool_calls": [call]}, {"role": "tool", "content": "noon"}])
    tools = check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, None, TOOLS)
    prompt = asyncio.run(render_chat(st, messages, tools, True, {}, None))
    assert '<tool>{"name": "get_weather"' in prompt.text
    assert '<invoke name="get_time">\n<parameter name="tz">UTC</parameter>\n</invoke>' in prompt.text
    assert prompt.text.endswith(']~b]ai\n<think>\n<minimax:tool_call>\n<invoke name="get_weather">\n')
    assert prompt.calls.fmt.name == FMT and prompt.calls.prefix == TOOL_FORMATS[FMT].forced_prefix("get_weather")
