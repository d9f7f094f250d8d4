"""Function calling, request side: a chat request's ``tools`` and ``tool_choice`` as what the
worker renders (`ToolSpec`s for the chat template) and how the answer is read (`ToolPlan`).

``tool_choice``:

* ``none``: the tools are in the prompt, the answer is text;
* ``auto`` (the default with tools): the model chooses; its text is read for calls in the
  format the model writes them in (its ``tool_call_parser`` setting, `tool_call_parser.py`);
* ``required`` or a named function: the answer is forced, as vLLM forces it, with the JSON
  output grammar: an array of ``{"name", "arguments"}`` (at least one; one when
  ``parallel_tool_calls`` is false), or the named function's arguments alone. This works with
  any chat template that renders tools, whatever format the model was trained to call in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from shoal.services.gateway.errors import BadRequest
from shoal.services.gateway.openai_api import ChatCompletionRequest, NamedToolChoice
from shoal.shared.messages import SamplingParams, ToolSpec
from shoal.shared.model_settings import ToolCallParser

ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's answer is read for function calls."""

    choice: ToolChoice
    parallel: bool = True
    """Several calls in one answer (``parallel_tool_calls``); False keeps the first."""
    function: str | None = None
    """The function a named ``tool_choice`` forces."""
    format: ToolCallParser = "hermes"
    """How the model writes calls (its ``tool_call_parser``), for ``auto``."""

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"


def tool_specs(req: ChatCompletionRequest) -> list[ToolSpec] | None:
    """The request's functions as the worker hands them to the chat template; 400 for two of one name."""
    if not req.tools:
        return None
    names = [tool.function.name for tool in req.tools]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise BadRequest(f"tools: each function needs its own name; {twice} appear more than once", param="tools")
    return [ToolSpec(tool.function.name, tool.function.description, tool.function.parameters) for tool in req.tools]


def tool_plan(req: ChatCompletionRequest, call_format: ToolCallParser = "hermes") -> ToolPlan | None:
    """How to read the answer for calls, made in `call_format`; None when the request has no
    tools (``tool_choice`` then may only be ``none`` or ``auto``, else a 400 as OpenAI answers)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice names a tool, but the request has no tools", param="tool_choice")
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in req.tools}:
            raise BadRequest(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                             param="tool_choice")
        return ToolPlan("named", parallel, choice.function.name, call_format)
    return ToolPlan(choice or "auto", parallel, format=call_format)


def forced(params: SamplingParams, plan: ToolPlan | None, req: ChatCompletionRequest) -> SamplingParams:
    """`params` with the JSON grammar a ``required`` or named ``tool_choice`` forces; a 400
    when ``response_format`` or a vLLM structured-output field shapes the answer too (one
    answer cannot follow both)."""
    if plan is None or plan.choice not in ("required", "named"):
        return params
    if params.has_grammar:
        raise BadRequest(f"{params.grammar_param} and a forced tool_choice cannot both shape the answer; send one",
                         param=params.grammar_param)
    parameters = {tool.function.name: _parameters_schema(tool.function.parameters) for tool in req.tools or ()}
    if plan.choice == "named":
        assert plan.function is not None, "a named choice names its function"
        schema: dict[str, Any] = parameters[plan.function]
    else:
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [
                {"type": "object",
                 "properties": {"name": {"const": name}, "arguments": arguments},
                 "required": ["name", "arguments"],
                 "additionalProperties": False}
                for name, arguments in parameters.items()
            ]},
        }
        if not plan.parallel:
            schema["maxItems"] = 1
    return msgspec.structs.replace(params, json_schema=msgspec.json.encode(schema).decode(),
                                   grammar_param="tools")


def _parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema; OpenAI lets it be absent: no arguments."""
    return parameters if parameters is not None else {"type": "object", "properties": {}}
