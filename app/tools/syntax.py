"""The call syntax (Hermes's): a call is a JSON object between these markers."""

from __future__ import annotations

OPEN, CLOSE = "<tool_call>", "</tool_call>"
