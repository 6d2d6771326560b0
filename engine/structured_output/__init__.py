"""Structured outputs: what a request's output must match (a JSON schema, JSON, a regex, a choice, an EBNF
grammar), compiled to a token grammar off the engine loop and applied as a token mask in the sampler.

`GrammarSpec` is what a request carries (plain, serialisable data, checked at the door with `check_spec`);
`StructuredOutputManager` (the scheduler's) compiles it in the background and keeps one matcher per
sequence; `apply_token_bitmask` masks the logits rows that have a grammar.
"""

from pagoda.engine.structured_output.check import check_spec
from pagoda.engine.structured_output.mask import TokenBitmask, apply_token_bitmask
from pagoda.engine.structured_output.spec import GRAMMAR_KINDS, GrammarSpec

__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "TokenBitmask", "apply_token_bitmask", "check_spec"]
