"""Graph recordings that fail on purpose, for start-up paths that must degrade to eager decoding. They
pickle, so tensor-parallel ranks (other processes) get them with the request they record for."""

from __future__ import annotations

from pagoda.engine.worker.decode_graphs import RerunCapture


class FailingCapture(RerunCapture):
    """Records as RerunCapture does, except on tensor-parallel rank ``rank`` (None: every rank), where a
    recording raises what a CUDA capture raises when a launch is illegal while recording."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank

    def __call__(self, forward):
        from pagoda.engine.distributed.parallel_state import tp_rank

        if self.rank is None or tp_rank() == self.rank:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().__call__(forward)
