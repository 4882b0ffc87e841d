"""DeepSeek-V4's chat encoding: the prompt its releases build in Python (`encoding/encoding_dsv4.py`,
`encode_messages`) instead of shipping a Jinja `chat_template`.

    text = encode_messages(messages, "thinking")                      # the reference's own entry point
    text = render_chat(messages, add_generation_prompt=True, tools=tools, enable_thinking=False)  # strata's

Why a Python renderer and not a built-in Jinja template: the encoding is list surgery before any text is
written (tool results merged into the user turn before them and re-ordered by the preceding calls, earlier
turns' reasoning dropped, tools moved onto the system message), which a sandboxed template could only mimic
with fragile namespace juggling; as plain code it follows the reference step by step and is checked against
the release's own test vectors (tests/generation/test_chat_dsv4.py). `Tokenizer` (strata.runtime.generation.
tokenizer) calls `render_chat` wherever a template would render, for a `deepseek_v4` checkpoint without a
template of its own, so OpenAI chat, Anthropic messages, /tokenize and `Engine.chat` all go through it.

The format: `<｜begin▁of▁sentence｜>` then the system text (tools appended as a "## Tools" section), each user
turn after `<｜User｜>`, each reply after `<｜Assistant｜>` as `reasoning</think>answer` plus a DSML block of calls
(`<｜DSML｜tool_calls>` ... `<｜DSML｜invoke name="NAME">` ... `<｜DSML｜parameter name="K" string="true|false">V
</｜DSML｜parameter>` ...) and `<｜end▁of▁sentence｜>`; tool results are `<tool_result>...</tool_result>` blocks in
a user turn. The generation prompt is `<｜Assistant｜><think>` in thinking mode, `<｜Assistant｜></think>` in chat
mode. The reference's internal roles and tasks (the search agent's `developer` turns, quick-instruction
`task` tokens) are encoded by `encode_messages` but refused by `render_chat`: a request has no use for them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from strata.errors import RequestError

__all__ = ["BOS", "EOS", "USER", "ASSISTANT", "THINK_START", "THINK_END", "DSML", "encode_messages",
           "encode_dsml_arguments", "render_chat", "render_tools"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
MODES = ("chat", "thinking")

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {start}), you MUST output your complete reasoning inside \
{start}...{end} BEFORE any tool calls or final response.

Otherwise, output directly after {end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" section for OpenAI-shaped `tools` ({"type": "function", "function": {...}})."""
    schemas = "\n".join(_json(t["function"]) for t in tools)
    return _TOOLS_SECTION.format(dsml=DSML, start=THINK_START, end=THINK_END, schemas=schemas)


def _call_arguments(arguments: Any) -> dict:
    """A call's arguments as a mapping: a JSON object's text is parsed; text that is no object is kept whole
    under "arguments", as the reference does for text it cannot parse."""
    if isinstance(arguments, dict):
        return dict(arguments)
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def encode_dsml_arguments(arguments: Any) -> str:
    """One call's arguments as DSML parameters, one a line: strings as they are (`string="true"`), other values
    as JSON (`string="false"`)."""
    lines = []
    for key, value in _call_arguments(arguments).items():
        is_str = isinstance(value, str)
        lines.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                     f"{value if is_str else _json(value)}</{DSML}parameter>")
    return "\n".join(lines)


def _calls_block(calls: list[dict]) -> str:
    invokes = [f'<{DSML}invoke name="{c["function"]["name"]}">\n{encode_dsml_arguments(c["function"].get("arguments"))}'
               f"\n</{DSML}invoke>" for c in calls]
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: text kept, anything else named
        content = "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                              for p in content)
    return f"<tool_result>{content}</tool_result>"


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Tool messages as `tool_result` blocks of a user turn (V4 has no tool role): consecutive results share one
    turn, and a user message right after them joins it (unless that turn carries a task)."""
    out: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        last_merged = out[-1] if out and out[-1].get("role") == "user" and "blocks" in out[-1] else None
        if role == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id", ""), "content": msg.get("content", "")}
            if last_merged is not None:
                last_merged["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if last_merged is not None and last_merged.get("task") is None:
                last_merged["blocks"].append(block)
            else:
                merged = {"role": "user", "content": msg.get("content", ""), "blocks": [block]}
                merged.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                out.append(merged)
        else:
            out.append(msg)
    return out


def _order_tool_results(messages: list[dict]) -> list[dict]:
    """Within each merged user turn, tool results in the order the assistant before it made the calls."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, call in enumerate(msg["tool_calls"]):
                if call_id := call.get("id") or call.get("function", {}).get("id", ""):
                    order[call_id] = i
        elif msg.get("role") == "user" and msg.get("blocks"):
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))  # stable: unknown ids keep place
                msg["blocks"] = [next(ranked) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return messages


def _last_user(messages: list[dict]) -> int:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") in ("user", "developer")),
                -1)


def _drop_old_reasoning(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistants lose their reasoning, developer turns go; the rest stays."""
    last = _last_user(messages)
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last:
            out.append(msg)
        elif role == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def _with_tools(text: str, msg: dict) -> str:
    if msg.get("tools"):
        text += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        text += "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" + \
            _json(msg["response_format"])
    return text


def _render(index: int, messages: list[dict], mode: str, drop_thinking: bool, effort: str | None,
            add_generation_prompt: bool) -> str:
    msg = messages[index]
    role = msg.get("role")
    last_user = _last_user(messages)
    text = REASONING_EFFORT_MAX if index == 0 and mode == "thinking" and effort == "max" else ""
    if role == "system":
        text += _with_tools(msg.get("content") or "", msg)
    elif role == "developer":
        if not msg.get("content"):
            raise ValueError(f"a developer message needs content: {msg}")
        text += _with_tools(USER + msg["content"], msg)
    elif role == "user":
        blocks = msg.get("blocks")
        if blocks:
            text += USER + "\n\n".join(b["text"] if b["type"] == "text" else _tool_result_text(b["content"])
                                       for b in blocks)
        else:
            text += USER + (msg.get("content") or "")
    elif role == "latest_reminder":
        text += LATEST_REMINDER + str(msg.get("content"))
    elif role == "assistant":
        reasoning = ""
        after_task = index > 0 and messages[index - 1].get("task") is not None  # a task's answer: no thinking
        if mode == "thinking" and not after_task and (not drop_thinking or index > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = _calls_block(msg["tool_calls"]) if msg.get("tool_calls") else ""
        text += reasoning + (msg.get("content") or "") + calls + ("" if msg.get("wo_eos") else EOS)
    else:
        raise ValueError(f"unknown role {role!r}")

    if index + 1 < len(messages) and messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return text
    if (task := msg.get("task")) is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASK_TOKENS)}")
        if task == "action":
            text += ASSISTANT + (THINK_START if mode == "thinking" else THINK_END)
        text += TASK_TOKENS[task]
    elif role in ("user", "developer") and (add_generation_prompt or index + 1 < len(messages)):
        # the turn that opens the assistant's reply: it starts thinking, or (chat mode, or an earlier turn whose
        # reasoning was dropped) starts past it
        opens_thinking = mode == "thinking" and (not drop_thinking or index >= last_user)
        text += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return text


def encode_messages(messages: list[dict], thinking_mode: str, drop_thinking: bool = True,
                    add_bos: bool = True, reasoning_effort: str | None = None,
                    add_generation_prompt: bool = True) -> str:
    """The prompt of `messages` as DeepSeek's reference `encode_messages` builds it (no `context` prefix).

    `thinking_mode` "thinking" or "chat"; `drop_thinking`: earlier turns' reasoning left out (kept whenever a
    message carries tools); `reasoning_effort` "max" prefixes the reference's effort instruction (thinking mode
    only), "high" or None add nothing; `add_generation_prompt` False leaves off the `<｜Assistant｜>` opening a
    reply after a final user turn (strata's switch; the reference always writes it). Malformed messages raise
    ValueError."""
    if thinking_mode not in MODES:
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    if reasoning_effort not in ("max", "high", None):
        raise ValueError(f"reasoning_effort must be 'max', 'high' or None, got {reasoning_effort!r}")
    msgs = _order_tool_results(_merge_tool_results(messages))
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking_mode == "thinking" and drop:
        msgs = _drop_old_reasoning(msgs)
    text = BOS if add_bos else ""
    for i in range(len(msgs)):
        text += _render(i, msgs, thinking_mode, drop, reasoning_effort, add_generation_prompt)
    return text


def _flag(kwargs: dict, name: str) -> bool | None:
    value = kwargs.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"chat_template_kwargs {name} must be true or false, got {value!r}"[:200])
    return value


def render_chat(messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """`messages` (OpenAI-shaped dicts: system, user, assistant with `reasoning_content` / `tool_calls`, tool)
    rendered for DeepSeek-V4, with the keyword arguments a chat template gets.

    `tools` go onto the leading system message (one is added when there is none), where the reference's test
    vectors put them. Thinking mode is on unless `enable_thinking` or `thinking` is false (either true turns it
    on); `reasoning_effort` "none" turns it off, "max" asks for maximum effort, any other level is the default
    ("high"); `drop_thinking` false keeps earlier turns' reasoning. A `developer` message or a `task` is refused
    (RequestError): those are DeepSeek's internal search-agent and classification formats."""
    for i, m in enumerate(messages):
        if m.get("role") == "developer":
            raise RequestError(f"messages[{i}]: DeepSeek-V4's prompt format has no developer role that a request "
                               "may use; send the instructions as a system message")
        if m.get("role") not in ("system", "user", "assistant", "tool", "latest_reminder"):
            raise RequestError(f"messages[{i}]: DeepSeek-V4's prompt format has no role {m.get('role')!r}; use "
                               "system, user, assistant or tool")
        if m.get("task") is not None:
            raise RequestError(f"messages[{i}]: DeepSeek-V4's quick-instruction tasks are not supported; leave "
                               "out the message's task")
    thinking, enable = _flag(kwargs, "thinking"), _flag(kwargs, "enable_thinking")
    mode = "thinking" if (thinking is None and enable is None) or thinking or enable else "chat"
    effort = kwargs.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise RequestError(f"reasoning_effort must be a string such as 'high' or 'max', got {effort!r}"[:200])
    if effort == "none":
        mode, effort = "chat", None
    elif effort is not None:
        effort = "max" if effort == "max" else "high"
    drop = _flag(kwargs, "drop_thinking")
    msgs = list(messages)
    if tools := kwargs.get("tools"):
        if msgs and msgs[0].get("role") == "system":
            msgs[0] = {**msgs[0], "tools": list(tools)}  # the request's tools replace any the message carries
        else:
            msgs.insert(0, {"role": "system", "tools": list(tools)})
    try:
        return encode_messages(msgs, mode, drop_thinking=drop is not False, reasoning_effort=effort,
                               add_generation_prompt=add_generation_prompt)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RequestError(f"these messages cannot be rendered in DeepSeek-V4's format ({type(e).__name__}: "
                           f"{' '.join(str(e).split())})"[:300]) from e
