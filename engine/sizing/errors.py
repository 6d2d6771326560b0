"""The one exception sizing raises, so callers (operator, CLI, engine start-up) can catch it by name."""


class SizingError(ValueError):
    """The inputs cannot be served as asked; the message says what fits and what to change."""
