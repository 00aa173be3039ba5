"""Fields shared by every generating endpoint.

Every request model forbids fields it does not declare: a parameter is honoured or refused with a
400 naming it, never dropped (`api/deps.validation_error` words OpenAI's "Unrecognized request
argument supplied").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationInfo

from llmserver.errors import InvalidRequest

MAX_STOP_STRINGS = 4

StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]

# llama.cpp's sampling parameters that are sent on as they are, when given.
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


class Strict(BaseModel):
    """A request object: unknown fields are refused, JSON types are strict as OpenAI's are ("4" is
    not a number, "yes" not a boolean) and numbers are finite (1e400 and Infinity are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Sampling(Strict):
    """Sampling parameters. Omitted ones are left to llama-server's defaults."""

    api_key: str | None = Field(default=None, description="The API key, when not sent as a Bearer token.")
    model: str | None = Field(default=None, description="Model name; default: the first configured model.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0, description="llama.cpp: sample from the k likeliest tokens (0: all).")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(
        default=None, ge=0.0, le=1.0, description="llama.cpp: drop tokens less likely than min_p times the likeliest."
    )
    max_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    repeat_penalty: float | None = Field(default=None, gt=0.0, description="llama.cpp: penalty for repeated tokens.")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-1, le=2**63 - 1, description="Same seed, same request: same answer.")

    keep_alive: float | None = Field(
        default=None, ge=0, description="Seconds to keep the model's instance from idling out after this request."
    )

    mode: Literal["sync", "async"] = Field(default="sync", description="`async`: answer at once with a tracking id.")
    key: str | None = Field(default=None, description="Async mode: base64 of 32 random bytes to encrypt the result.")
    webhook_url: str | None = Field(default=None, description="Async mode: where to POST the result when ready.")

    def sampling_fields(self) -> dict[str, Any]:
        # Those the request set (every default is None), by name: a tiny request sets one or two of them.
        given = sorted(self.model_fields_set.intersection(SAMPLING_FIELDS))
        return {name: value for name in given if (value := getattr(self, name)) is not None}


@dataclass
class AsChat:
    """A request of another API read as the chat request it amounts to: its chat body (to validate as
    any chat request), where in the request each chat message came from, the request's own names of
    chat parameters (both to name them in errors), and a thinking budget (Anthropic's)."""

    body: dict[str, Any]
    origins: list[str]
    names: dict[str, str]
    budget: int | None = None
    optional_thinking: bool = False  # the effort asked for is a wish: a model that cannot think answers without
    names_stop: bool = False  # the answer says which stop sequence ended it (Anthropic's `stop_sequence`)


class AsChatRequest(Strict):
    """A request of another API that is a chat request underneath."""

    def chat(self) -> AsChat:
        raise NotImplementedError


def refused(what: str) -> Any:
    """A field the client's API defines that this server does not do: refused (400 naming it) when present."""
    return Field(default=None, description=f"Refused: {what}.")


def absent(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """The check of a `refused` field (its validator): only null (or false) passes; the refusal says why."""
    if value is not None and value is not False:
        described = model.model_fields[str(info.field_name)].description or ""
        raise ValueError(f"not supported by this server: {described.removeprefix('Refused: ').rstrip('.')}")
    return value


def string_field(item: dict[str, Any], name: str, where: str) -> str:
    """`item[name]`, which must be a string (a 400 naming `where.name` if not)."""
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{name}: a string is required", param=f"{where}.{name}")
    return value


def normalize_stop(stop: list[str] | None) -> list[str]:
    return stop or []


StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


def _one_string_as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


# OpenAI accepts one stop string or a list of them; both arrive here as a list.
StopStringOrList = Annotated[StopList, BeforeValidator(_one_string_as_list)]

# OpenAI's logit_bias: token ids (as JSON object keys) → a bias from -100 to 100.
TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
LogitBias = Annotated[dict[TokenId, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)]
