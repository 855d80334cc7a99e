"""Tools an agent can call: a named callable with a JSON-schema description, registered by name.

A :class:`Tool` is what a chat template's ``tools=`` takes (:meth:`Tool.schema` is the OpenAI /
Hugging Face function schema, ``{"type": "function", "function": {"name", "description",
"parameters"}}``) plus the function that answers a call. :data:`TOOLS` holds them by name, like
rewards and algorithms, so a config's ``tools: [calculator]`` is checked against it.

Calls never raise into the episode: :func:`call_tools` turns an unknown tool, arguments the schema
rejects, or an exception in the tool into a :class:`ToolResult` with ``ok=False`` whose text the
model reads as the tool's answer (what verl's and TRL's agent loops do), and the episode counts it.

Bundled tools: ``calculator`` (integer/decimal arithmetic, parsed with :mod:`ast`, never ``eval``)
and ``python`` (a program run by :func:`verl_core.sandbox.runner.run_python` in a child process
with rlimits, a timeout and no network; its stdout is the answer).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_RESULT_CHARS = 2000  # a tool's answer is cut to this many characters before it enters the context


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its arguments (a dict once parsed)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer as the model reads it; ``ok=False`` for any error (counted in the metrics)."""

    text: str
    ok: bool = True


@dataclass(frozen=True)
class Tool:
    """``fn(**arguments) -> str`` answers one call; ``batch_fn(list of argument dicts) -> list[ToolResult]``
    (optional) answers several at once (the python tool runs its programs in parallel)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": [...]}
    fn: Callable[..., str]
    batch_fn: Callable[[list[dict[str, Any]]], list[ToolResult]] | None = field(default=None, compare=False)

    def schema(self) -> dict[str, Any]:
        """The function schema chat templates render (``apply_chat_template(messages, tools=[...])``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool, overwrite: bool = False) -> Tool:
    if tool.name in TOOLS and not overwrite:
        raise ValueError(f"tool {tool.name!r} is already registered")
    TOOLS[tool.name] = tool
    return tool


def get_tools(names: Sequence[str]) -> dict[str, Tool]:
    """The registered tools ``names``; ValueError naming the unknown one and the known ones."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool {unknown[0]!r}; registered: {', '.join(sorted(TOOLS))}")
    return {n: TOOLS[n] for n in names}


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def argument_error(tool: Tool, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's schema (required, unexpected, JSON type), or None.

    The subset of JSON Schema tool schemas use: an object of typed properties, some required."""
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    extra = [k for k in arguments if k not in props]
    if extra:
        return f"unexpected argument {extra[0]!r} (takes {', '.join(props) or 'none'})"
    for key, value in arguments.items():
        kind = props[key].get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"argument {key!r} must be {kind}, got {type(value).__name__}"
    return None


def _cut(text: str) -> str:
    return text if len(text) <= MAX_RESULT_CHARS else text[: MAX_RESULT_CHARS - 3] + "..."


def call_tools(calls: Sequence[ToolCall], tools: dict[str, Tool]) -> list[ToolResult]:
    """Answer every call (in order), each tool's calls together through its ``batch_fn`` when it has one."""
    results: list[ToolResult | None] = [None] * len(calls)
    batches: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        tool = tools.get(call.name)
        problem = (
            f"unknown tool {call.name!r}; available: {', '.join(tools) or 'none'}"
            if tool is None
            else argument_error(tool, call.arguments)
        )
        if problem is not None:
            results[i] = ToolResult(f"error: {problem}", ok=False)
        elif tool.batch_fn is not None:
            batches.setdefault(call.name, []).append(i)
        else:
            results[i] = _call_one(tool, call.arguments)
    for name, rows in batches.items():
        try:
            answers = tools[name].batch_fn([calls[i].arguments for i in rows])
        except Exception as err:  # a tool's failure is the episode's data, never the trainer's exception
            answers = [ToolResult(f"error: {type(err).__name__}: {err}", ok=False)] * len(rows)
        for i, answer in zip(rows, answers):
            results[i] = ToolResult(_cut(answer.text), answer.ok)
    return results  # type: ignore[return-value]


def _call_one(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    try:
        return ToolResult(_cut(str(tool.fn(**arguments))))
    except Exception as err:
        return ToolResult(_cut(f"error: {type(err).__name__}: {err}"), ok=False)


# --- calculator -------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_BINARY.update({ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow})
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_MAGNITUDE = 10**15  # beyond this the calculator refuses (no 9**9**9 to hang the trainer)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (``+ - * / // % **`` and parentheses on numbers).

    >>> calculate("37 * 4 + 19")
    '167'
    >>> calculate("7 / 2")
    '3.5'
    """

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("exponent too large")
            out = _BINARY[type(node.op)](left, right)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            out = _UNARY[type(node.op)](value(node.operand))
        else:
            raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
        if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE or (isinstance(out, float) and not math.isfinite(out)):
            raise ValueError("result out of range")
        return out

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


CALCULATOR = register_tool(
    Tool(
        "calculator",
        "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 * 4 + 19"}},
            "required": ["expression"],
        },
        calculate,
    )
)


# --- python (the sandbox) ---------------------------------------------------------------------


def _sandbox_answer(result: Any) -> ToolResult:
    """A sandbox run as the model reads it: stdout, or the error's reason and stderr's tail."""
    if result.ok:
        return ToolResult(result.stdout.strip() or "(no output)")
    tail = (result.stderr or "").strip().splitlines()[-3:]
    return ToolResult(f"error ({result.status}): {result.reason or ''} {' '.join(tail)}".strip(), ok=False)


def run_python_tool(code: str) -> str:
    from verl_core.sandbox.runner import run_python  # imported when used: the sandbox is its own module

    answer = _sandbox_answer(run_python(code))
    if not answer.ok:
        raise RuntimeError(answer.text)
    return answer.text


def run_python_batch(arguments: list[dict[str, Any]]) -> list[ToolResult]:
    from verl_core.sandbox.runner import run_many

    return [_sandbox_answer(r) for r in run_many([a["code"] for a in arguments])]


PYTHON = register_tool(
    Tool(
        "python",
        "Run a Python program in a sandbox (no network, no files kept, a few seconds) and return what it prints.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print the result"}},
            "required": ["code"],
        },
        run_python_tool,
        batch_fn=run_python_batch,
    )
)
