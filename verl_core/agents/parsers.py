"""Tool-call parsers by name (:data:`TOOL_CALL_PARSERS`): the text of one policy turn -> the calls in it.

- ``hermes`` (Hermes / Qwen2.5 / Qwen3, what verl's and TRL's agent loops and vLLM's ``hermes`` parser
  read): ``<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>``, any
  number per turn; ``arguments`` may also be a JSON string holding the object.
- ``pythonic`` (Llama 3.2 / 4, vLLM's ``pythonic`` parser): a Python list of calls with keyword
  arguments, ``[calculator(expression="2 + 3")]``; shorter, which is why the embedded default's task uses it.

A turn with no call is the episode's final answer. A call that cannot be read (bad JSON, no name, an
unclosed tag, positional or non-literal arguments) is a :class:`ParsedTurn` error: the environment
answers it as a tool error, and the episode goes on.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from verl_core.agents.tools import ToolCall


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per call that could not be read

    @property
    def wants_tools(self) -> bool:
        """Whether the turn asked for any tool (a readable call or a malformed one)."""
        return bool(self.calls or self.errors)


ToolCallParser = Callable[[str], ParsedTurn]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_parser(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    def decorator(fn: ToolCallParser) -> ToolCallParser:
        TOOL_CALL_PARSERS[name] = fn
        return fn

    return decorator


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks.

    >>> parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>').calls
    [ToolCall(name='calculator', arguments={'expression': '1+2'})]
    >>> parse_hermes('<tool_call>{"name": calculator}</tool_call>').errors
    ['tool call is not valid JSON: Expecting value at char 9']
    """
    out = ParsedTurn()
    for match in _HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            out.errors.append("tool call has no closing </tool_call>")
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            out.errors.append(f"tool call is not valid JSON: {err.msg} at char {err.pos}")
            continue
        _add_call(out, data)
    return out


def _add_call(out: ParsedTurn, data) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        out.errors.append('tool call needs {"name": ..., "arguments": {...}}')
        return
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            out.errors.append(f"arguments of {data['name']!r} are not a JSON object")
            return
    out.calls.append(ToolCall(data["name"], arguments))


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


@register_parser("pythonic")
def parse_pythonic(text: str) -> ParsedTurn:
    """A list of calls ``[name(key=literal, ...), ...]`` anywhere in the turn.

    >>> parse_pythonic('[calculator(expression="37 * 4 + 19")]').calls
    [ToolCall(name='calculator', arguments={'expression': '37 * 4 + 19'})]
    >>> parse_pythonic('[calculator(37 * 4)]').errors
    ['tool call calculator(...) takes keyword arguments only']
    """
    out = ParsedTurn()
    start = _PYTHONIC_START.search(text)
    if start is None:
        return out
    body = text[start.start() :]
    end = body.rfind("]")
    try:
        tree = ast.parse(body[: end + 1] if end >= 0 else body, mode="eval").body
    except SyntaxError:
        out.errors.append("tool call is not a Python list of calls: [name(key=value)]")
        return out
    if not isinstance(tree, ast.List):
        out.errors.append("tool call is not a Python list of calls: [name(key=value)]")
        return out
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
            out.errors.append("tool call is not name(key=value)")
            continue
        name = ast.unparse(node.func)
        if node.args:
            out.errors.append(f"tool call {name}(...) takes keyword arguments only")
            continue
        try:
            out.calls.append(ToolCall(name, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        except (ValueError, TypeError, SyntaxError):
            out.errors.append(f"arguments of {name!r} must be literals")
    return out


def get_parser(name: str) -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; registered: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[name]
