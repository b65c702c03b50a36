"""Structured outputs and tool calling on the OpenAI API: request fields → one grammar
(``StructuredOutputsParams``), and tool calls read back from the constrained text.

Accepted, as OpenAI and vLLM spell them (one source per request): ``response_format`` (``text``,
``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), the legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and chat ``tools`` with ``tool_choice``:

- a named function: the output is that function's arguments, constrained to its ``parameters`` schema;
- ``required``: a JSON array of one or more ``{"name", "parameters"}`` calls, each name one of the tools
  and its parameters that tool's schema (vLLM's form);
- ``auto`` (the default with tools): free text; a reply that is a tool call (``{"name", "arguments"}``
  JSON, a list of them, or one inside ``<tool_call>`` tags) comes back as ``tool_calls``;
- ``none``: free text, never read as a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.structured import StructuredOutputsParams

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _json_schema_of(value: Any, param: str) -> dict | str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object)", param=param)
    return value


def structured_from_request(extra: dict, tool_spec: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The request's grammar (None: free text) from its extra fields; two sources at once are a 400."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = extra.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                      "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                      param="response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True, param="response_format")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
                raise InvalidRequestError("response_format.json_schema must be an object with name and schema",
                                          param="response_format.json_schema")
            schema = _json_schema_of(spec.get("schema", {}), "response_format.json_schema.schema")
            found.append(("response_format", StructuredOutputsParams(json=schema, param="response_format.json_schema")))
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs must be an object with one of json, regex, choice, grammar, "
                                      "json_object", param="structured_outputs")
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                    "whitespace_pattern", "structural_tag", "disable_additional_properties"})
        if unknown or so.get("structural_tag") is not None:
            raise InvalidRequestError(f"structured_outputs: unsupported keys {unknown or ['structural_tag']}; use "
                                      "json, regex, choice, grammar or json_object", param="structured_outputs")
        fields = {k: so[k] for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) is not None}
        if "json" in fields:
            fields["json"] = _json_schema_of(fields["json"], "structured_outputs.json")
        found.append(("structured_outputs", StructuredOutputsParams(
            **fields, disable_any_whitespace=bool(so.get("disable_any_whitespace")), param="structured_outputs")))
    for name, kind in LEGACY.items():
        value = extra.get(name)
        if value is None:
            continue
        if kind == "json":
            value = _json_schema_of(value, name)
        found.append((name, StructuredOutputsParams(**{kind: value}, param=name)))
    if tool_spec is not None:
        found.append(("tool_choice", tool_spec))
    if len(found) > 1:
        raise InvalidRequestError(f"{' and '.join(n for n, _ in found)} both constrain the output; send one",
                                  param=found[1][0])
    return found[0][1] if found else None


# -- tools ---------------------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a chat request's tools ask for: the grammar (named / required), and how to read the reply."""

    tools: list[dict]  # the request's tools (OpenAI's {"type": "function", "function": {...}})
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named tool_choice
    parallel: bool = True  # parallel_tool_calls: false allows one call per reply

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def grammar(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), param="tool_choice")
        if self.choice == "required":
            return StructuredOutputsParams(json=self.calls_schema(), param="tool_choice")
        return None

    def calls_schema(self) -> dict:
        """The JSON schema of a reply that is calls: a list of {name, parameters} of this request's tools
        (their ``$defs`` moved to the root, where their ``#/$defs/...`` references point)."""
        params, defs = hoist_defs([self._parameters(n) for n in self.names])
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"]} for n, p in zip(self.names, params)]
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return {**array, **defs}

    def _parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def calls(self, text: str) -> list[dict] | None:
        """The reply as OpenAI ``tool_calls`` (None: a plain answer)."""
        if self.choice == "named":
            return [tool_call(self.named, text)]
        if self.choice == "none":
            return None
        found = _parse_calls(text)
        if found is None:
            return None
        if self.choice == "auto" and any(name not in self.names for name, _ in found):
            return None  # JSON that names no tool of this request is an answer, not a call
        if not self.parallel:  # one call per reply: the next turn may call again
            found = found[:1]
        return [tool_call(name, args) for name, args in found]


def hoist_defs(schemas: list[dict]) -> tuple[list[dict], dict]:
    """Schemas to nest in a larger one: each without its ``$defs`` / ``definitions``, and those merged, to
    put at the larger schema's root (a root-relative ``#/$defs/X`` reference then still resolves). Two
    schemas defining one name differently cannot share a root: a 400 that says so."""
    bare, defs = [], {}
    for schema in schemas:
        if not isinstance(schema, dict):
            bare.append(schema)
            continue
        bare.append({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
        for key in ("$defs", "definitions"):
            for name, value in (schema.get(key) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, value) != value:
                    raise InvalidRequestError(f"two schemas of this request define {key}/{name} differently; rename "
                                              "one of them", param="tools")
    return bare, defs


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _parse_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] from a reply that is only tool calls: a JSON object with name and
    arguments (or parameters), a list of them, or such objects in <tool_call> tags."""
    text = text.strip()
    tagged = _TAGGED.findall(text)
    if tagged and not _TAGGED.sub("", text).strip():
        items = []
        for chunk in tagged:
            try:
                items.append(json.loads(chunk))
            except ValueError:
                return None
    else:
        try:
            items = json.loads(text)
        except ValueError:
            return None
    items = items if isinstance(items, list) else [items]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        out.append((item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return out or None


def tool_plan(body_extra: dict) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (None: no tools)."""
    tools, choice = body_extra.get("tools"), body_extra.get("tool_choice")
    if body_extra.get("functions") not in (None, []) or body_extra.get("function_call") not in (None, "none", "auto"):
        raise InvalidRequestError("functions / function_call are deprecated; send tools / tool_choice",
                                  param="functions")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                      "\"parameters\": {...}}}", param=f"tools.{i}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                                      param=f"tools.{i}.function.parameters")
    names = [t["function"]["name"] for t in tools]
    parallel = True if body_extra.get("parallel_tool_calls") is None else body_extra["parallel_tool_calls"]
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among tools {names}",
                                      param="tool_choice")
        return ToolPlan(tools, "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}", param="tool_choice")
    return ToolPlan(tools, choice, parallel=parallel)


def tools_prompt(tools: list[dict]) -> str:
    """A system message describing the tools, for a chat template that does not render ``tools`` itself."""
    specs = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return ("You can call these functions. To call one, reply with only a JSON object "
            "{\"name\": <function name>, \"arguments\": <arguments object>}.\nFunctions: " + specs)
