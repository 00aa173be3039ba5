"""What an instance's chat template can do, learnt from llama-server when the instance starts
(`pool/instance.py` renders the template with and without tools and thinking): the engine decides
prompted tools and reasoning by it (engine/tools.py, engine/reasoning.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """What an instance's chat template can do."""

    tools: bool = False  # renders tools and tool calls itself
    thinks: bool = False  # thinks, and takes enable_thinking
    effort: bool = False  # takes an effort level itself (llama-server's supports_reasoning_effort)
