"""Prefill/decode disaggregation in the router: the prefill replicas, and which one a request names.

With ``--prefill-backend`` / ``--prefill-backend-dns`` the router keeps a second pool (discovery, health,
load and KV index as for the decode replicas), picks a prefill replica for every request with the same
policy (prefix-aware: the replica that already holds most of the prompt's blocks prefills the least), and
forwards the request to the decode replica it chose as usual, with ``x-prefiller-host-port: HOST:PORT`` of
that prefill replica (llm-d's convention). The decode engine asks it to prefill, fetches the blocks and
decodes; with no routable prefill replica the header is left out and the decode replica prefills itself.

A client's own ``x-prefiller-host-port`` is never passed on: only the router names prefill engines.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from pagoda.router.backends import BackendPool
from pagoda.router.chain import ChainHasher
from pagoda.router.config import RouterConfig
from pagoda.router.picking import Picker
from pagoda.router.policies import Router

PREFILLER_HEADER = "x-prefiller-host-port"


class PrefillPool:
    def __init__(self, config: RouterConfig, hasher: ChainHasher, needs_chain: bool) -> None:
        own = dataclasses.replace(
            config, backends=list(config.prefill_backends), backend_dns=list(config.prefill_backend_dns)
        )
        self.pool = BackendPool(own)
        self.picker = Picker(self.pool, Router(config.policy, config.load_slack), hasher, needs_chain)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def choose(self, ids: list[int] | None, model: object) -> tuple[str, str] | None:
        """(the replica's URL, its ``HOST:PORT`` for the header), or None when no prefill replica is routable."""
        backends = self.pool.routable()
        if not backends:
            return None
        b, _, chain = self.picker.choose(backends, ids, model)
        if chain:
            b.index.predict(chain)  # its prefill caches the prompt's blocks there
        return b.url, urlsplit(b.url).netloc

    def to_dicts(self) -> list[dict]:
        return [b.to_dict() for b in self.pool.backends.values()]


def enabled(config: RouterConfig) -> bool:
    return bool(config.prefill_backends or config.prefill_backend_dns)
