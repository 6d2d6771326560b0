"""The routing decision itself, shared by the HTTP proxy (app.py) and the Envoy ext_proc endpoint picker
(ext_proc.py): a request's token ids (local tokenizer, else a replica's /tokenize), its block chain (with a
LoRA adapter's root), and the policy's choice among the replicas given. Both front ends therefore route
alike: the same prefix, tier, adapter and load rules, the same predictions in the block index."""

from __future__ import annotations

from typing import Any

import aiohttp
from pagoda.router.backends import Backend, BackendPool, adapter_holders
from pagoda.router.chain import ChainHasher, chain_of
from pagoda.router.policies import Decision, Router


class Picker:
    def __init__(self, pool: BackendPool, router: Router, hasher: ChainHasher, needs_chain: bool) -> None:
        self.pool = pool
        self.router = router
        self.hasher = hasher
        self.needs_chain = needs_chain  # only the cache policies read the chain

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's ids as the engine computes them; None without a cache policy or when unknown."""
        if not self.needs_chain:
            return None
        ids = self.hasher.token_ids(path, body)
        if ids is not None or self.hasher.tokenizer is not None:
            return ids
        return await self._remote_token_ids(path, body)

    async def _remote_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """No local tokenizer: a replica's /tokenize gives the same ids (one more round trip)."""
        backends = self.pool.routable()
        if not backends or self.pool.session is None:
            return None
        if path.endswith("/chat/completions"):
            req = {
                "messages": body.get("messages"),
                "add_generation_prompt": body.get("add_generation_prompt", True),
            }
        elif isinstance(body.get("prompt"), str):
            req = {"prompt": body["prompt"]}
        else:
            return None
        b = min(backends, key=lambda x: x.load)
        try:
            async with self.pool.session.post(b.url + "/tokenize", json=req) as r:
                if r.status == 200:
                    return (await r.json())["tokens"]
        except (aiohttp.ClientError, OSError, KeyError, ValueError):
            pass
        return None

    def choose(
        self, backends: list[Backend], ids: list[int] | None, model: object = None
    ) -> tuple[Backend, Decision, list[str]]:
        """The replica for a request among ``backends`` (not empty), the policy's decision and the chain."""
        # A LoRA adapter's request goes to a replica that has it loaded, when one has, with its chain.
        backends, root = adapter_holders(backends, model)
        cands = [b.candidate() for b in backends]
        chain: list[str] = []
        info = next((b.info for b in backends if b.info), None)
        if ids is not None and info:  # the replicas of one deployment share block size and extra keys
            chain = chain_of(ids, int(info["block_size"]), tuple(info.get("extra_keys") or ()), root)
        decision = self.router.choose(cands, chain, len(ids) if ids is not None else 0)
        chosen = next(b for b in backends if b.url == decision.name)
        return chosen, decision, chain
