"""OpenAI-shaped errors and request parsing: `APIError` (answered as `{"error": {"message", "type", "param",
"code"}}` with an HTTP status), a JSON body read strictly (no lone UTF-16 surrogates), pydantic's and strata's
validation errors as 400s naming the field, and the context-length error."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from strata.errors import RequestError

_TYPE_TAGS = {"str", "int", "bool", "float", "dict", "list", "none"}
# a JSON \u escape of a UTF-16 surrogate: only these can put a lone surrogate into a parsed string
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 in OpenAI's shape."""
    return APIError(400, message, "invalid_request_error", param, code)


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; anything else (binary garbage, a bare list, bad UTF-8) is a 400."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # a pair is joined into one character by json; a lone half is not text
        where = _lone_surrogate(data, "")
        if where is not None:
            raise bad_request(f"{where or 'a key'}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                              "escape), which is not Unicode text; send valid UTF-8", param=where or None)
    return data


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) under `value` holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _has_surrogate(key):
            return here
        found = _lone_surrogate(item, here)
        if found is not None:
            return found
    return None


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first offending field."""
    err = e.errors()[0]
    # drop union-branch tags ("str", "list[ContentPart]") that pydantic puts in the location
    loc = [str(p) for p in err.get("loc", ()) if not ("[" in str(p) or str(p) in _TYPE_TAGS)]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")  # our own validators' ValueErrors
    got = f", got {err['input']!r}"[:120] if loc and "input" in err and err.get("type") != "missing" else ""
    return bad_request(f"{param + ': ' if param else ''}{msg}{got}", param=param)


def parse_request(model: type[BaseModel], data: dict) -> Any:
    """Validate `data` as `model`, turning pydantic's and strata's errors into 400s."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RequestError as e:
        raise bad_request(str(e), param=getattr(e, "param", None)) from None


def context_error(prompt_tokens: int, max_tokens: int, context: int, param: str) -> APIError:
    """The 400 for prompt + max_tokens over the context, worded as OpenAI words it."""
    where = "messages" if param == "messages" else "prompt"
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.", param=param, code="context_length_exceeded")
