"""One flag naming: every `pagoda serve` flag the operator and `pagoda plan` render comes from a setting's name
(an EngineConfig field or a server setting) through serve's own parser, and parses back to the same value."""

from __future__ import annotations

import pytest
from pagoda.engine.cli.engine_args import cli_fields
from pagoda.engine.cli.serve_args import flag, parse_args, to_argv
from pagoda.engine.sizing import Hints, gpu_info, plan, well_known_shape


def test_every_engine_field_has_its_flag() -> None:
    for f in cli_fields():
        assert flag(f.name) == "--" + f.name.replace("_", "-")
    assert flag("max_num_queued_reqs") == "--max-num-queued-reqs" and flag("host") == "--host"
    with pytest.raises(KeyError, match="no flag for 'max_model_length'"):
        flag("max_model_length")


@pytest.mark.parametrize("gpu", [None, "H100", "L4"])
def test_a_plan_rendered_by_field_parses_back_to_its_fields(gpu: str | None) -> None:
    p = plan(
        well_known_shape("Qwen/Qwen2.5-7B-Instruct"),
        gpu and gpu_info(gpu),
        Hints(memory_limit_bytes=64 << 30),
    )
    settings = p.engine_settings()
    args = parse_args(to_argv(settings))
    for name, value in settings.items():
        if value is not None:
            assert str(getattr(args, name)) == str(value), name


def test_booleans_and_lists_render_as_serve_takes_them() -> None:
    argv = to_argv({"enable_prefix_caching": False, "enable_lora": True, "lora_modules": ["a=/x", "b=/y"]})
    assert argv == ["--no-enable-prefix-caching", "--enable-lora", "--lora-modules", "a=/x", "b=/y"]
    args = parse_args(argv)
    assert args.enable_prefix_caching is False and args.lora_modules == ["a=/x", "b=/y"]
