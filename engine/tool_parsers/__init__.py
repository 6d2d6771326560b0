"""Tool calling: reading the calls out of a model's output, per model family (`--tool-call-parser`)."""

from pagoda.engine.tool_parsers.parsers import (
    FORMATS,
    PARSERS,
    Harmony,
    NamedCall,
    RequiredCalls,
    ToolParser,
    parser_for_template,
    writes_harmony,
)
from pagoda.engine.tool_parsers.stream import ToolCall, ToolCallStream, extract

__all__ = [
    "FORMATS",
    "PARSERS",
    "Harmony",
    "NamedCall",
    "RequiredCalls",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "extract",
    "parser_for_template",
    "writes_harmony",
]
