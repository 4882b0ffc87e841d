"""The tool-call parsers on the output formats of the model families strata runs (Qwen3, Qwen3-Coder, DeepSeek-V3
and V3.1, GLM-4.5, Kimi K2, gpt-oss), whole and streamed in every split; calls written by chat templates of each family's
shape parse back to the calls they render; malformed output is text."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from strata.runtime.generation.text.tokenizer import Tokenizer, _compile_template
from strata.server.tools.calls import TOOL_FORMATS, CallParsing, Delta, parse_output, tool_format
from strata.server.tools.request import ToolRequestError, check_tool_choice, check_tools, template_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

# (format, model output, content, reasoning, [(name, arguments)])
OUTPUTS = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.", "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
     "", "", [("get_weather", {"city": "Oslo"})]),  # arguments sent as a JSON string
    ("hermes", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3"
               "\n</parameter>\n<parameter=units>\n10\n</parameter>\n</function>\n</tool_call>",
     "", "", [("get_weather", {"city": "San Francisco", "days": 3, "units": "10"})]),  # Qwen3-Coder's XML
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", "", []),
    ("deepseek", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Hangzhou"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                 '```json\n{"tz": "Asia/Shanghai"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", "", [("get_weather", {"city": "Hangzhou"}), ("get_time", {"tz": "Asia/Shanghai"})]),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Beijing", "days": 1}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", "", [("get_weather", {"city": "Beijing", "days": 1})]),  # V3.1: no type, no fence
    ("glm45", "I will look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>3</arg_value>\n"
              "</tool_call>",
     "I will look it up.", "", [("get_weather", {"city": "Beijing", "days": 3, "units": "3"})]),
    ("glm45", "<tool_call>get_time\n</tool_call>", "", "", [("get_time", {})]),
    ("kimi_k2", "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>\n<|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>',
     "Let me check.", "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
    ("kimi_k2", '<|tool_calls_section_begin|> <|tool_call_begin|> get_time:3 <|tool_call_argument_begin|> {} '
                "<|tool_call_end|> <|tool_calls_section_end|>", "", "", [("get_time", {})]),  # no prefix, spaces
    ("harmony", "<|channel|>analysis<|message|>Need the weather; call get_weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"San Francisco"}',
     "", "Need the weather; call get_weather.", [("get_weather", {"city": "San Francisco"})]),
    ("harmony", "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is 4.",
     "It is 4.", "Simple.", []),
    ("harmony", '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>',
     "", "", [("get_time", {"tz": "UTC"})]),
    ("harmony", "Plain text from a model that wrote no channels.", "Plain text from a model that wrote no channels.",
     "", []),
]

# output whose call does not parse: returned as the text it is
MALFORMED = [
    ("hermes", 'Try:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut off by max_tokens
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{oops}\n```"
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("glm45", "<tool_call>get weather now\n<arg_key>city</arg_key>\n</tool_call>"),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{not json"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Par<|tool_call_end|><|tool_calls_section_end|>'),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{}'
                "<|tool_call_end|><|tool_calls_section_end|>"),  # an id without its index
]


def _calls(d: Delta) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in d.calls]


def _streamed(fmt: str, text: str, cuts: list[int]) -> Delta:
    stream = TOOL_FORMATS[fmt].stream(TOOLS)
    out, last = Delta(), 0
    for cut in [*cuts, len(text)]:
        out += stream.feed(text[last:cut])
        last = cut
    out += stream.flush()
    return out


@pytest.mark.parametrize(("fmt", "text", "content", "reasoning", "calls"), OUTPUTS)
def test_each_format_parses_whole_and_in_every_split(fmt, text, content, reasoning, calls):
    whole = parse_output(TOOL_FORMATS[fmt], text, TOOLS)
    assert (whole.content, whole.reasoning, _calls(whole)) == (content, reasoning, calls)
    assert len({c.id for c in whole.calls}) == len(calls)
    if fmt == "kimi_k2":  # Kimi's own ids: its template writes a call back by its `functions.NAME:IDX`
        assert all(c.id.split(":")[0].split(".")[-1] == c.name for c in whole.calls)
    else:
        assert all(c.id.startswith("call_") for c in whole.calls)
    rng = random.Random(7)
    splits = [list(range(1, len(text))), [len(text) // 2]] + [sorted(rng.sample(range(1, len(text)), 12))
                                                              for _ in range(20)]
    for cuts in splits:  # one character at a time, halves, random pieces: the same answer
        got = _streamed(fmt, text, cuts)
        assert (got.content, got.reasoning, _calls(got)) == (content, reasoning, calls), cuts


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_a_call_that_does_not_parse_is_text(fmt, text):
    got = parse_output(TOOL_FORMATS[fmt], text, TOOLS)
    assert got.calls == [] and got.content == text
    assert _streamed(fmt, text, list(range(1, len(text)))).content == got.content


def test_text_streams_out_before_a_call_completes():
    stream = TOOL_FORMATS["hermes"].stream(TOOLS)
    assert stream.feed("Checking the weather").content == "Checking the weather"
    assert stream.feed(" now.\n<tool").content == " now."  # the tail that could begin a call waits
    d = stream.feed('_call>\n{"name": "get_time", "arguments": {}}')
    assert d.content == "" and d.calls == []  # no call until its end marker
    d = stream.feed("\n</tool_call>")
    assert _calls(d) == [("get_time", {})]
    assert stream.flush().content == ""
    stream = TOOL_FORMATS["hermes"].stream(TOOLS)  # a lone "<" that never becomes a call is text
    assert stream.feed("a <").content == "a" and stream.feed("b").content == " <b" and stream.flush().content == ""


def test_forced_prefixes_lead_the_model_into_a_call():
    """What `tool_choice` required / named appends to the prompt, followed by what a model writes next, is a call."""
    rest = {"hermes": ('{"city": "Rome"}}\n</tool_call>', 'get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
            "glm45": ("<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
                      "get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"),
            "deepseek": ('get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',) * 2,
            "harmony": ('{"city": "Rome"}', 'get_weather <|constrain|>json<|message|>{"city": "Rome"}'),
            "kimi_k2": ('{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>',
                        'get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
                        "<|tool_calls_section_end|>")}
    for name, (after_named, after_required) in rest.items():
        fmt = TOOL_FORMATS[name]
        for prefix, after in ((fmt.forced_prefix("get_weather"), after_named), (fmt.forced_prefix(None), after_required)):
            assert _calls(parse_output(fmt, prefix + after, TOOLS)) == [("get_weather", {"city": "Rome"})], name


def _tokenizer(extra: list[str]) -> Tokenizer:
    tok = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.add_special_tokens(extra)
    return Tokenizer(tok, {}, {})


def test_the_format_comes_from_the_vocabulary_then_the_model_type():
    cases = [(["<tool_call>", "</tool_call>"], "qwen3_moe", "hermes"),
             (["<tool_call>", "<arg_key>", "<arg_value>"], "glm4_moe", "glm45"),
             (["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"], "deepseek_v3", "deepseek"),
             (["<|tool_calls_section_begin|>", "<|tool_call_begin|>"], "kimi_k2", "kimi_k2"), ([], "kimi_k2", "kimi_k2"),
             (["<|channel|>", "<|message|>", "<|call|>"], "gpt_oss", "harmony"),
             ([], "deepseek_v3", "deepseek"), ([], "gpt_oss", "harmony"), ([], "glm4_moe", "glm45"),
             ([], "qwen3_moe", "hermes"), ([], "mixtral", "hermes"),
             (["<tool_call>"], "deepseek_v3", "hermes")]  # the vocabulary wins over the type
    for tokens, model_type, expected in cases:
        assert tool_format(model_type, _tokenizer(tokens)).name == expected, (tokens, model_type)
    assert tool_format("qwen3_moe", None).name == "hermes"
    # what the chat template writes for a call wins over both
    calls = {"hermes": '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
             "glm45": "<|assistant|>\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
             "deepseek": "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
             "harmony": "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
             "kimi_k2": "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
                        "functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"}
    for expected, text in calls.items():
        assert tool_format("deepseek_v3", _tokenizer(["<tool_call>"]), template_call=text).name == expected
    assert tool_format("qwen3_moe", _tokenizer([]), "glm45").name == "glm45"  # --tool-call-parser


# what each family's template does with a call's arguments: Qwen3 tojson, GLM .items(), DeepSeek string concatenation
TEMPLATES = {
    "hermes": "{% for m in messages %}{% for tc in m.tool_calls %}{% if tc.function %}{% set tc = tc.function %}{% endif %}"
              '<tool_call>\n{"name": "{{ tc.name }}", "arguments": {% if tc.arguments is string %}{{ tc.arguments }}'
              "{% else %}{{ tc.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}{% endfor %}",
    "glm45": "{% for m in messages %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}\n"
             "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>"
             "{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}{% endfor %}",
    "deepseek": "{% for m in messages %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}"
                "{{ '<｜tool▁call▁begin｜>' + tc['type'] + '<｜tool▁sep｜>' + tc['function']['name'] + '\\n' + '```json' "
                "+ '\\n' + tc['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}{% endfor %}"
                "<｜tool▁calls▁end｜>{% endfor %}",
}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_calls_rendered_by_each_familys_template_parse_back(fmt):
    """An assistant turn's OpenAI tool_calls (arguments as JSON text) reach the template in the form it reads, and
    the text it writes is what the model of that family writes: parsing it gives the same calls."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Zürich", "days": 2}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    messages = [{"role": "assistant", "content": "", "tool_calls": template_tool_calls(calls, "messages.0.tool_calls")}]
    text = _compile_template(TEMPLATES[fmt]).render(messages=messages)
    assert "Zürich" in text  # written as text, not as an escape or a Python repr
    assert _calls(parse_output(TOOL_FORMATS[fmt], text, TOOLS)) == [("get_weather", {"city": "Zürich", "days": 2}),
                                                                   ("get_time", {"tz": "UTC"})]


# Kimi K2's template: each call written back by its id, its arguments as sent
KIMI_TEMPLATE = ("{% for m in messages %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>"
                 "{{ tc['id'] }}<|tool_call_argument_begin|>{% if tc['function']['arguments'] is string %}"
                 "{{ tc['function']['arguments'] }}{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}"
                 "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endfor %}")


def test_kimi_calls_go_back_to_the_template_by_their_ids():
    """A Kimi K2 answer's calls, sent back by a client as the assistant turn's tool_calls, render as the model wrote
    them: their ids are the model's `functions.NAME:IDX`, so the turn parses back to the same calls and ids."""
    text = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Zürich", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
            '<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|><|tool_calls_section_end|>')
    answer = parse_output(TOOL_FORMATS["kimi_k2"], text, TOOLS)
    sent = [c.openai() for c in answer.calls]
    assert [c["id"] for c in sent] == ["functions.get_weather:0", "functions.get_time:1"]
    messages = [{"role": "assistant", "content": "", "tool_calls": template_tool_calls(sent, "messages.0.tool_calls")}]
    again = _compile_template(KIMI_TEMPLATE).render(messages=messages)
    assert "Zürich" in again
    back = parse_output(TOOL_FORMATS["kimi_k2"], again, TOOLS)
    assert _calls(back) == _calls(answer) and [c.id for c in back.calls] == [c["id"] for c in sent]


def test_tools_and_tool_choice_are_checked():
    assert check_tools(None, None) == []
    assert check_tools(None, [{"name": "f", "parameters": {"type": "object"}}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    bad = [([{"type": "retrieval"}], None, "tools.0"), ([{"type": "function", "function": {"name": "a b"}}], None, "tools.0"),
           ([WEATHER, WEATHER], None, "tools"), ("x", None, "tools"), (None, [{"name": 5}], "functions.0"),
           ([WEATHER], [{"name": "f"}], "functions"),
           ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools.0")]
    for tools, functions, param in bad:
        with pytest.raises(ToolRequestError) as e:
            check_tools(tools, functions)
        assert e.value.param == param, (tools, functions)
    r = check_tool_choice({"type": "function", "function": {"name": "get_time"}}, None, TOOLS, False)
    assert (r.choice, r.name, r.parallel, r.active, r.forced) == ("named", "get_time", False, True, True)
    assert check_tool_choice(None, {"name": "get_time"}, TOOLS).name == "get_time"  # the older function_call
    assert not check_tool_choice("none", None, TOOLS).active and not check_tool_choice(None, None, []).active
    assert check_tool_choice("required", None, TOOLS).forced and not check_tool_choice("auto", None, TOOLS).forced
    for choice, tools in (("sometimes", TOOLS), ("required", []), ({"type": "function", "function": {"name": "nope"}},
                                                                   TOOLS), ({"type": "function"}, TOOLS)):
        with pytest.raises(ToolRequestError):
            check_tool_choice(choice, None, tools)


def test_parallel_false_keeps_the_first_call():
    from strata.server.render import ChatFormat, Seq, TokenText

    text = OUTPUTS[0][1]
    fmt = ChatFormat(TokenText(None), False, False, False, 1, CallParsing(TOOL_FORMATS["hermes"], tuple(TOOLS),
                                                                          parallel=False))
    seq = Seq(0, [1], None, None, finish_reason="stop")

    class Event:
        token_id, logprob, top_logprobs = 5, None, None

        def __init__(self, text, finish=None):
            self.text, self.finish_reason = text, finish

    fmt.on_event(seq, Event(text))
    fmt.on_event(seq, Event("", "stop"))
    choice = fmt.choices([seq])[0]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in choice["message"]["tool_calls"]] \
        == ["get_weather"] and choice["message"]["content"] == "Let me check."
