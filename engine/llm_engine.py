"""LLMEngine: the synchronous engine core (scheduler + KV cache manager + model runner + detokenizer).

CONTRACT (being implemented by the engine-core work; the server builds on exactly this):

    engine = LLMEngine(EngineConfig(...), stat_loggers=[...])
    engine.config          # EngineConfig, with max_model_len resolved to an int
    engine.max_model_len   # int
    engine.model_name      # served model name (config.served_model_name or the model's name)
    engine.tokenizer       # a transformers PreTrainedTokenizerBase loaded from the local model directory
    engine.add_request(request_id, prompt, params, *, arrival_time=None, priority=0)
        prompt: str | list[int] (token ids). Raises ValueError for bad input, e.g. a prompt that does not
        fit: "This model's maximum context length is N tokens; the prompt has M tokens". max_tokens beyond
        the remaining context is clamped; max_tokens=None means "up to the context limit".
    engine.abort_request(request_id | iterable of ids)   # frees the request's blocks at once
    engine.step() -> list[RequestOutput]                  # outputs (cumulative) of requests that progressed
    engine.has_unfinished_requests() -> bool
    engine.get_num_unfinished_requests() -> int
    engine.get_scheduler_stats() -> SchedulerStats
    engine.reset_prefix_cache() -> bool
    engine.add_stat_logger(logger)   # logger.record(SchedulerStats, IterationStats) after every step

Not thread-safe: one thread drives step(); other threads hand requests to that thread.
"""
