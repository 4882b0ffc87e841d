"""A chat request's prompt, shared by OpenAI's chat completions and Anthropic's Messages API: the messages (and
tools) rendered through the model's own chat template, the start of a forced call, the context bound, the ids.

With tools (and `tool_choice` other than "none") the template gets `tools=`, as transformers passes them, and
the output is parsed for the calls of the model's format (strata.server.tools.calls). A template that does not
write the tools into the prompt is refused: its model could not know them. `tool_choice` "required" or a named
function appends the start of a call to the prompt (the format's `forced_prefix`), so the model writes one;
not where the prompt ends inside an open thinking block, which the model finishes first. A harmony model's
(gpt-oss) output is always read through its parser, which splits its channels into reasoning and answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from strata.server.api_errors import bad_request
from strata.server.prompts import refuse_past_context, require_tokenizer
from strata.server.tools.calls import CallParsing
from strata.server.tools.request import ToolRequest, template_tool_calls

THINK_TAGS = ("<think>", "</think>")
_PROBE_TOOL = {"type": "function", "function": {"name": "strata_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass
class ChatPrompt:
    """A rendered chat prompt: its `text` and token `ids`, whether it ends inside an open thinking block, and how
    its output is read for calls (None: not at all)."""

    text: str
    ids: list[int]
    in_reasoning: bool
    calls: CallParsing | None


async def render_chat(st: Any, messages: list[dict], tools: ToolRequest, add_generation_prompt: bool,
                      template_kwargs: dict[str, Any], max_tokens: Any) -> ChatPrompt:
    """Render `messages` (template-ready dicts) with `tools` through the served model's chat template and encode
    them; tokenizing and rendering run off the event loop, so a huge prompt stalls no other stream."""
    tok = require_tokenizer(st.engine, "messages")
    kwargs = {k: v for k, v in template_kwargs.items() if k not in ("messages", "add_generation_prompt", "tools")}
    if tools.active:
        if not st.template_renders_tools:
            raise bad_request("this model's chat template does not write tools into the prompt, so the model cannot "
                              'call them; send no tools (or tool_choice "none"), or serve a model whose template '
                              "supports tool use", param="tools", code="tools_not_supported")
        kwargs["tools"] = list(tools.tools)
    text = await asyncio.to_thread(tok.apply_chat_template, messages, add_generation_prompt, **kwargs)
    in_reasoning = st.think and text.rstrip().endswith(THINK_TAGS[0])  # the template opened the thinking block
    calls = None
    if tools.active:
        prefix = st.tool_format.forced_prefix(tools.name) if tools.forced and add_generation_prompt \
            and not in_reasoning else ""
        text += prefix
        calls = CallParsing(st.tool_format, tools.tools, prefix, tools.parallel)
    elif st.tool_format.name == "harmony":  # gpt-oss writes its reasoning and answer in channels, tools or not
        calls = CallParsing(st.tool_format)
    refuse_past_context(st.engine, text, "messages", max_tokens)
    ids = await asyncio.to_thread(tok.encode, text, False)
    return ChatPrompt(text, ids, in_reasoning, calls)


def template_tool_messages(messages: list[dict]) -> list[dict]:
    """Messages whose tool calls are put in the form templates read (`template_tool_calls`)."""
    return [{**m, "tool_calls": template_tool_calls(m["tool_calls"], "messages")} if m.get("tool_calls") else m
            for m in messages]


def renders_tools(tok: Any) -> bool:
    """Whether a chat template writes the tools it is given into the prompt (found by rendering a probe tool; a
    template that fails on the probe is given the benefit of the doubt: a request's own rendering reports it)."""
    if tok is None or not tok.has_chat_template:
        return False
    try:
        return _PROBE_TOOL["function"]["name"] in tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                                                          True, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001
        return True


def template_call_text(tok: Any) -> str | None:
    """What a chat template writes for an assistant turn that called a tool (None: it fails on one, or there is
    no template): its markers tell the format the model writes calls in (strata.server.tools.calls.tool_format)."""
    if tok is None or not tok.has_chat_template:
        return None
    call = {"id": "call_probe", "type": "function", "function": {"name": "strata_probe_tool", "arguments": {}}}
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_probe", "content": "done"}]
    try:
        return tok.apply_chat_template(template_tool_messages(messages), False, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - the format is then told by the vocabulary and the model type
        return None
