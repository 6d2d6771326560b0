"""How a model's layers split into pipeline stages: one rule for the engine, the dry run and the planner.

Stages are contiguous runs of layers, as even as possible. When the layers do not divide evenly the extra
layers go to stages 1, 2, ... and not to stage 0, whose rank 0 also schedules and samples for the replica
(with more stages than extra layers, stage 0 never gets one). The embedding lives on the first stage, the
final norm and the LM head on the last; every stage keeps KV only for its own layers.
"""

from __future__ import annotations


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers; ValueError when there are fewer layers than stages."""
    if stages < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if num_layers < stages:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    counts = [base + (1 if 1 <= s <= extra else 0) for s in range(stages)]
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def stage_of_rank(rank: int, tensor_parallel_size: int) -> int:
    """The stage of global rank ``rank`` (ranks are stage-major: stage = rank // T, TP rank = rank % T)."""
    return rank // tensor_parallel_size


def max_stage_layers(num_layers: int, stages: int) -> int:
    """Layers of the largest stage: its KV per token sizes the blocks every stage allocates."""
    return max(hi - lo for lo, hi in stage_layers(num_layers, stages))


def host_ranks(world: int, nnodes: int, node_rank: int) -> range:
    """The global ranks host ``node_rank`` of ``nnodes`` runs (world / nnodes consecutive ranks)."""
    per = world // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def stage_weight_bytes(
    weight_bytes: int,
    num_layers: int,
    stages: int,
    vocab_size: int,
    hidden_size: int,
    element_bytes: int,
    tie_word_embeddings: bool,
) -> list[int]:
    """Each stage's share of ``weight_bytes`` (the whole replica's, before tensor parallelism): its layers'
    part of what the embedding and the LM head leave, plus the embedding on the first stage (and on the last
    when the LM head is tied to it) and the LM head on the last."""
    embed = vocab_size * hidden_size * element_bytes
    head = 0 if tie_word_embeddings else embed
    per_layer = max(weight_bytes - embed - head, 0) / max(num_layers, 1)
    out = []
    for s, (lo, hi) in enumerate(stage_layers(num_layers, stages)):
        first, last = s == 0, s == stages - 1
        b = per_layer * (hi - lo)
        b += embed if first or (last and tie_word_embeddings) else 0
        b += head if last else 0
        out.append(int(b))
    return out


def stages_report(
    num_layers: int,
    tensor_parallel_size: int,
    stages: int,
    nnodes: int,
    node_rank: int,
    kv_bytes_per_token_per_layer: int,
    weights_per_stage: list[int],
    num_blocks: int | None,
    block_size: int,
) -> list[dict]:
    """The dry run's per-stage table: layers, global ranks (and which this host runs), KV bytes per token
    and, once the plan has blocks, the KV cache each of the stage's ranks allocates."""
    world = tensor_parallel_size * stages
    mine = set(host_ranks(world, nnodes, node_rank))
    out = []
    for s, (lo, hi) in enumerate(stage_layers(num_layers, stages)):
        ranks = list(range(s * tensor_parallel_size, (s + 1) * tensor_parallel_size))
        bpt = kv_bytes_per_token_per_layer * (hi - lo)
        out.append(
            {
                "stage": s,
                "layers": [lo, hi],
                "num_layers": hi - lo,
                "ranks": ranks,
                "ranks_on_this_host": [r for r in ranks if r in mine],
                "host": ranks[0] // (world // nnodes),
                "embedding": s == 0,
                "lm_head": s == stages - 1,
                "kv_bytes_per_token_per_rank": bpt,
                "kv_cache_bytes_per_rank": None if num_blocks is None else num_blocks * block_size * bpt,
                "weights_bytes_per_rank": -(-weights_per_stage[s] // tensor_parallel_size),
            }
        )
    return out
