"""Chat messages -> what a chat template renders, tools and tool history included, never dropped.

A template that knows tools (its source uses `tools` and `tool_calls`, as Qwen2.5's, Llama 3.1's and
Mistral's do) gets them as Hugging Face templates expect: `tools=[...]`, assistant messages with
`tool_calls` whose arguments are objects, tool messages with `tool_call_id`. A template that does not (the
default model's ChatML) gets the same facts as text in the hermes format (engine/tool_parsers): the tools
in a system message with the format to call them, each assistant call as a `<tool_call>` block in its
content, each tool result as a `<tool_response>` block in a user turn.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PREAMBLE = (
    "You can call functions to help with the user's request. The functions are listed, as JSON "
    "schemas, between <tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, each holding a JSON object with the function's "
    "name and its arguments:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "The results come back between <tool_response> and </tool_response>."
)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_calls" in template


def _arguments(call: dict) -> Any:
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def hermes_call(call: dict) -> str:
    fn = call.get("function", {})
    body = json.dumps({"name": fn.get("name"), "arguments": _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def template_messages(
    messages: list[dict], tools: list[dict] | None, knows_tools: bool
) -> tuple[list[dict], dict[str, Any]]:
    """(messages for the template, extra template arguments). ``messages`` are OpenAI-shaped dicts with
    text content (role, content, name, tool_calls, tool_call_id)."""
    if knows_tools:
        out = []
        for m in messages:
            d = {k: v for k, v in m.items() if v is not None}
            if d.get("tool_calls"):
                d["tool_calls"] = [
                    {**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}}
                    for c in d["tool_calls"]
                ]
            out.append(d)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(hermes_call(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            d = {"role": role, "content": content}
            if m.get("name"):
                d["name"] = m["name"]
            out.append(d)
    for d in out:
        d.pop("_tool_results", None)
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, {}
