"""Reasoning models: what a request's reasoning effort (or an Anthropic thinking budget) becomes in
llama-server's payload, decided by what the instance's chat template can do.

llama-server separates a thinking template's reasoning from its answer (`reasoning_content`), turns
thinking on or off through the template's `enable_thinking`, and cuts it at `thinking_budget_tokens`.
Whether a template thinks is learnt when its instance starts (`pool/instance.py`: the template rendered
with thinking on and off differs). The levels map to a share of the request's max_tokens, so that
the answer always keeps room after the thinking:

| effort | thinking | budget |
|---|---|---|
| none | off | - |
| minimal | on | 1/8 of max_tokens |
| low | on | 1/4 |
| medium | on | 1/2 |
| high, xhigh | on | none (up to max_tokens) |

A template that also takes an effort level itself (`supports_reasoning_effort`) is given it as well.
Demanding reasoning of a template that does not think is refused, naming the parameter; wishing for
it (Anthropic's `adaptive` thinking, an effort level alone) or asking for none of it is answered
without.
"""

from __future__ import annotations

from typing import Any

from llmserver.errors import InvalidRequest
from llmserver.llama.template import Template

JSON = dict[str, Any]

BUDGET_SHARE = {"minimal": 8, "low": 4, "medium": 2}


def fields(
    effort: str | None, budget: int | None, max_tokens: int, template: Template, model: str, optional: bool = False
) -> JSON:
    """llama-server's payload fields for a request's reasoning effort (or explicit budget); {} for
    neither. `effort` is "none" for thinking off; `optional`: thinking is wished for, not demanded."""
    if effort is None and budget is None:
        return {}
    if not template.thinks:
        if effort == "none" or optional:
            return {}
        raise InvalidRequest(
            f"reasoning_effort: the chat template of {model!r} does not think, so reasoning cannot be asked of it "
            "(leave this out, or use a model whose template thinks).",
            param="reasoning_effort",
        )
    if effort == "none":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    out: JSON = {"chat_template_kwargs": {"enable_thinking": True}}
    if budget is None and effort in BUDGET_SHARE:
        budget = max(1, max_tokens // BUDGET_SHARE[effort])
    if budget is not None:
        out["thinking_budget_tokens"] = min(budget, max_tokens)
    if template.effort and effort is not None:
        out["reasoning_effort"] = effort
    return out
