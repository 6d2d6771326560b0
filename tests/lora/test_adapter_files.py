"""PEFT adapter directories: what is read (safetensors only, the PEFT scale rules) and what is refused, with
a message that names the problem."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from pagoda.engine.lora import AdapterError, LoRARegistry, ModuleShape, load_adapter
from pagoda.engine.lora.adapter import UnreadableAdapterError
from pagoda.engine.lora.patterns import PatternError, PatternTable, compile_key
from safetensors.torch import save_file

SHAPES = {
    "q_proj": ModuleShape(8, 8),
    "k_proj": ModuleShape(8, 4),
    "v_proj": ModuleShape(8, 4),
    "o_proj": ModuleShape(8, 8),
    "gate_proj": ModuleShape(8, 16),
    "up_proj": ModuleShape(8, 16),
    "down_proj": ModuleShape(16, 8),
}
LAYERS = 2


def write_adapter(path: Path, config: dict | None = None, tensors: dict | None = None, r: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "down_proj"],
        "bias": "none",
    }
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = {}
        for layer in range(LAYERS):
            for parent, module in (("self_attn", "q_proj"), ("mlp", "down_proj")):
                shape = SHAPES[module]
                prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.full((r, shape.in_features), 0.5)
                tensors[f"{prefix}.lora_B.weight"] = torch.full((shape.out_features, r), 1.0)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_reads_matrices_and_folds_the_scale_into_b(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path / "a"), LAYERS, SHAPES, max_rank=16)
    assert adapter.rank == 2 and set(adapter.modules) == {
        (0, "q_proj"),
        (0, "down_proj"),
        (1, "q_proj"),
        (1, "down_proj"),
    }
    a, b = adapter.modules[(1, "down_proj")]
    assert a.shape == (2, 16) and b.shape == (8, 2)
    assert torch.all(b == 2.0)  # lora_alpha / r = 4 / 2
    rs = load_adapter(write_adapter(tmp_path / "rs", {"use_rslora": True}), LAYERS, SHAPES, 16)
    assert torch.allclose(rs.modules[(0, "q_proj")][1], torch.full((8, 2), 4 / math.sqrt(2)))
    pattern = write_adapter(tmp_path / "p", {"alpha_pattern": {"down_proj": 8}})
    scaled = load_adapter(pattern, LAYERS, SHAPES, 16).modules
    assert torch.all(scaled[(0, "down_proj")][1] == 4.0) and torch.all(scaled[(0, "q_proj")][1] == 2.0)


def test_fingerprint_follows_the_weights_and_scale_not_the_path(tmp_path):
    one = load_adapter(write_adapter(tmp_path / "one"), LAYERS, SHAPES, 16)
    two = load_adapter(write_adapter(tmp_path / "two"), LAYERS, SHAPES, 16)
    alpha = load_adapter(write_adapter(tmp_path / "alpha", {"lora_alpha": 8}), LAYERS, SHAPES, 16)
    assert one.fingerprint == two.fingerprint != alpha.fingerprint


def test_pickled_weights_are_never_loaded(tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    (path / "adapter_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(
        UnreadableAdapterError, match=r"safe_serialization=True; pickled weights are never"
    ) as err:
        load_adapter(path, LAYERS, SHAPES, 16)
    assert "adapter_model.bin (a pickle, never loaded)" in err.value.detail  # for the log only


def _tensor(layer, parent, module, which, shape):
    return {
        f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight": torch.zeros(shape)
    }


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"bias": "all"}, None, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"peft_type": "IA3"}, None, "peft_type IA3"),
        ({"r": 0}, None, "r must be a positive number"),
        ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 8)}, "not a LoRA matrix"),
        ({}, {**_tensor(0, "mlp", "q_proj", "A", (2, 8)), **_tensor(0, "mlp", "q_proj", "B", (8, 2))}, "not a supported target"),
        ({}, {**_tensor(5, "self_attn", "q_proj", "A", (2, 8)), **_tensor(5, "self_attn", "q_proj", "B", (8, 2))}, "layer 5 does not exist"),
        ({}, _tensor(0, "self_attn", "q_proj", "A", (2, 8)), "lora_A without its pair"),
        ({}, {**_tensor(0, "self_attn", "k_proj", "A", (2, 8)), **_tensor(0, "self_attn", "k_proj", "B", (8, 2))}, r"needs \[r, 8\] and \[4, r\]"),
        ({"r": 4}, {**_tensor(0, "self_attn", "q_proj", "A", (2, 8)), **_tensor(0, "self_attn", "q_proj", "B", (8, 2))}, "rank 2, its config says 4"),
    ],
)  # fmt: skip
def test_refusals_name_the_problem(tmp_path, config, tensors, message):
    with pytest.raises(AdapterError, match=message):
        load_adapter(write_adapter(tmp_path / "bad", config, tensors), LAYERS, SHAPES, 16)


def test_rank_above_the_engines_limit_says_which_flag(tmp_path):
    with pytest.raises(
        AdapterError, match="above --max-lora-rank 2; start the engine with --max-lora-rank 4"
    ):
        load_adapter(write_adapter(tmp_path / "r4", r=4), LAYERS, SHAPES, max_rank=2)


def test_registry_names_ids_and_unload(tmp_path):
    registry = LoRARegistry(LAYERS, SHAPES, 16, reserved_names=("base-model",))
    path = write_adapter(tmp_path / "a")
    first = registry.load("sql", path)
    with pytest.raises(AdapterError, match="already been loaded"):
        registry.load("sql", path)
    with pytest.raises(AdapterError, match="base model's name"):
        registry.load("base-model", path)
    with pytest.raises(AdapterError, match="must be 1-128 letters"):
        registry.load("bad name", path)
    with pytest.raises(AdapterError, match="not a readable PEFT adapter directory"):
        registry.load("empty", tmp_path)
    again = registry.load("sql-copy", path)
    assert again.id != first.id and again.cache_root == first.cache_root  # same weights, same KV
    assert [a.name for a in registry.adapters()] == ["sql", "sql-copy"]
    assert registry.unload("sql") is first and "sql" not in registry
    with pytest.raises(KeyError, match="cannot be found"):
        registry.unload("sql")
    assert registry.load("sql", path).id not in (first.id, again.id)


# ---------------------------------------------------------------- rank_pattern / alpha_pattern keys

MODULE_NAMES = [
    f"model.layers.{i}.{parent}.{module}"
    for i in (0, 1, 2, 10, 11)
    for module, parent in (
        ("q_proj", "self_attn"),
        ("v_proj", "self_attn"),
        ("up_proj", "mlp"),
        ("down_proj", "mlp"),
    )
] + ["q_proj", "lm_head", "a.b", "", "model.q_proj.x", "model.layers.1.mlp.down_projx"]
# What PEFT users and PEFT itself (EVA writes full module names) put in the patterns.
PEFT_KEYS = [
    "q_proj", "down_proj", "model.layers.0.self_attn.q_proj", "^model.layers.0.self_attn.q_proj",
    "layers.1.mlp.down_proj", r"layers\.\d+\.mlp\..*", r".*\.mlp\..*", "(q|v)_proj", "(?:q|v)_proj",
    r"layers\.1[01]?\..*", r"layers\.[0-2]\.self_attn\.q_proj", "layers.1", "q.proj", "proj", "", ".*",
    "^q_proj$", "mlp.down_proj|self_attn.q_proj", r"[^.]*_proj", r"\w+", r"layers\.\d{1,2}\.mlp\.up_proj",
    r"layers\.\d{2}\.mlp\.up_proj", "a{", r"[]q]_proj", r"[a-z_]+", "model.*q_proj", "^$", "x?q_proj",
    r"model\.layers\.(0|1)\.self_attn\.[qkv]_proj", "layers.1.*?proj", r"down_proj\Z"[:-2] + "$",
]  # fmt: skip


def peft_matches(key: str, name: str) -> bool:
    """PEFT's own rule (peft.utils.other.get_pattern_key), run with `re` on safe keys only."""
    return re.match(rf"(.*\.)?({key})$", name) is not None


@pytest.mark.parametrize("key", PEFT_KEYS)
def test_pattern_keys_mean_what_they_mean_to_peft(key):
    matcher = compile_key(key)
    assert [matcher.matches(n) for n in MODULE_NAMES] == [peft_matches(key, n) for n in MODULE_NAMES]


ATOMS = [
    "q",
    "_",
    "proj",
    "layers",
    "mlp",
    "0",
    "1",
    ".",
    r"\.",
    r"\d",
    r"\w",
    "[a-q]",
    "[^.]",
    "[0-9_]",
    "^",
    "$",
]


@st.composite
def safe_keys(draw, depth: int = 0) -> str:
    """Keys of the supported kind: atoms (optionally quantified) and unrepeated groups with alternatives."""
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        if depth < 2 and draw(st.integers(0, 5)) == 0:
            branches = draw(st.lists(safe_keys(depth + 1), min_size=1, max_size=3))
            parts.append("(" + "|".join(branches) + ")")
        else:
            atom = draw(st.sampled_from(ATOMS))
            quantifier = draw(st.sampled_from(["", "", "", "*", "+", "?", "{1,2}", "*?"]))
            parts.append(atom + (quantifier if atom not in ("^", "$") and len(atom) <= 5 else ""))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(key=safe_keys(), extra=st.text(alphabet="q_proj.0123lm", max_size=12))
def test_supported_keys_agree_with_peft_on_any_name(key, extra):
    matcher = compile_key(key)
    for name in [*MODULE_NAMES[::3], extra]:
        assert matcher.matches(name) == peft_matches(key, name), (key, name)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("(.|.)*Z", r"a repeated group \('\(\.\|\.\)\*'\) is not supported"),
        ("(a+)+$", "a repeated group"),
        ("(q_proj){2,}", "a repeated group"),
        (r"(q)\1", "back-references"),
        ("(?=q)q_proj", "look-arounds"),
        ("(?i)Q_PROJ", "inline flags"),
        ("q_proj*+", "possessive"),
        ("a{1000}", "repeats more than"),
        ("(q_proj", "not a valid regular expression"),
        ("x" * 600, "longer than"),
    ],
)
def test_keys_that_cannot_be_matched_safely_refuse_the_adapter(tmp_path, key, message):
    for field in ("rank_pattern", "alpha_pattern"):
        path = write_adapter(tmp_path / field, {field: {"down_proj": 2, key: 2}})
        start = time.perf_counter()
        with pytest.raises(AdapterError, match=f"adapter_config.json: {field}: pattern key .*{message}"):
            load_adapter(path, LAYERS, SHAPES, 16)
        assert time.perf_counter() - start < 1.0


def test_the_work_of_matching_is_bounded_too():
    """Within the supported kind, matching visits a bounded number of states for a whole adapter."""
    keys = {"|".join([".*" * 10 + f"_{j}"] * 20): 2 for j in range(8)}
    table = PatternTable(keys, "rank_pattern")
    start = time.perf_counter()
    with pytest.raises(PatternError, match=r"pattern key '\.\*.*'\.\.\.: matching .* takes too long"):
        for i in range(600):
            table.value(f"model.layers.{i}.self_attn.q_proj", 4)
    assert time.perf_counter() - start < 10.0


def test_patterns_set_rank_and_alpha_as_peft_does(tmp_path):
    """A tiny Llama adapted by peft itself with rank and alpha patterns: every module's rank and scale here
    are peft's."""
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        rank_pattern={
            "^model.layers.0.self_attn.q_proj": 2,
            r"layers\.[12]\.mlp\.(up|down)_proj": 6,
            "v_proj": 3,
        },
        alpha_pattern={"model.layers.2.mlp.down_proj": 3, r".*\.self_attn\..*": 5},
    )
    peft_model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    peft_model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    shapes = {
        "q_proj": ModuleShape(16, 16), "k_proj": ModuleShape(16, 8), "v_proj": ModuleShape(16, 8),
        "o_proj": ModuleShape(16, 16), "gate_proj": ModuleShape(16, 32), "up_proj": ModuleShape(16, 32),
        "down_proj": ModuleShape(32, 16),
    }  # fmt: skip
    ours = load_adapter(tmp_path / "adapter", 3, shapes, 16).modules
    seen = 0
    for name, module in peft_model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        layer, kind = int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1]
        a, b = ours[(layer, kind)]
        assert a.shape[0] == module.r["default"], name
        want_b = module.lora_B["default"].weight * module.scaling["default"]
        assert torch.allclose(b, want_b), name
        seen += 1
    assert seen == 12 and {m.shape[0] for m, _ in ours.values()} == {2, 3, 4, 6}


# ---------------------------------------------------------------- what a runtime load may learn and hold


def test_every_unreadable_path_gets_the_same_message(tmp_path):
    """Whoever may load adapters learns nothing about which files exist: one message for every path that is not
    a readable adapter (the log gets the reason)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    write_adapter(tmp_path / "no-weights").joinpath("adapter_model.safetensors").unlink()
    write_adapter(tmp_path / "pickled").joinpath("adapter_model.safetensors").rename(
        tmp_path / "pickled" / "adapter_model.bin"
    )
    write_adapter(tmp_path / "bad-json").joinpath("adapter_config.json").write_text("{not json")
    write_adapter(tmp_path / "list-json").joinpath("adapter_config.json").write_text("[1]")
    write_adapter(tmp_path / "bad-weights").joinpath("adapter_model.safetensors").write_bytes(b"\0" * 64)
    config_dir = write_adapter(tmp_path / "config-dir")
    config_dir.joinpath("adapter_config.json").unlink()
    config_dir.joinpath("adapter_config.json").mkdir()
    paths = [
        "/nonexistent/adapter", "/etc", "/etc/hostname", "/proc/self", "/dev/zero", "org/not-in-cache",
        "bad\0byte", *(str(tmp_path / n) for n in (
            "file", "empty", "no-weights", "pickled", "bad-json", "list-json", "bad-weights", "config-dir"
        )),
    ]  # fmt: skip
    registry = LoRARegistry(LAYERS, SHAPES, 16, reserved_names=())
    messages = set()
    for path in paths:
        with pytest.raises(UnreadableAdapterError) as err:
            registry.load("probe", path)
        messages.add(str(err.value).replace(repr(path), "PATH"))
    assert messages == {
        "LoRA adapter path PATH is not a readable PEFT adapter directory: it needs adapter_config.json and "
        "adapter_model.safetensors (weights saved with safe_serialization=True; pickled weights are never loaded)"
    }
    assert registry.adapters() == []


def test_the_same_content_under_two_names_is_stored_once(tmp_path):
    registry = LoRARegistry(LAYERS, SHAPES, 16, reserved_names=())
    path = write_adapter(tmp_path / "a")
    copy = write_adapter(tmp_path / "copy")  # the same files in another folder
    other = write_adapter(tmp_path / "other", {"lora_alpha": 8})
    first, second, third = (
        registry.load("one", path),
        registry.load("two", path),
        registry.load("three", copy),
    )
    assert first.weights is second.weights is third.weights
    assert (first.path, third.path) == (str(path), str(copy))  # each name keeps where it was loaded from
    assert registry.load("four", other).weights is not first.weights
    registry.unload("one")
    registry.unload("two")
    assert registry.get("three").weights is first.weights  # still served, still the one copy
    registry.unload("three")
    assert registry.load("five", path).weights is not first.weights  # nothing of that content was left
    assert len(registry._weights) == 2


def test_loads_past_max_cpu_loras_are_refused_before_reading(tmp_path):
    registry = LoRARegistry(LAYERS, SHAPES, 16, reserved_names=(), max_adapters=2)
    path = write_adapter(tmp_path / "a")
    registry.load("one", path)
    registry.load("two", path)
    for target in (path, "/nonexistent"):  # refused before anything is read
        with pytest.raises(
            AdapterError, match=r"2 LoRA adapters are loaded, as many as --max-cpu-loras \(2\)"
        ):
            registry.load("three", target)
    registry.unload("one")
    assert registry.load("three", path).name == "three"


def test_max_cpu_loras_is_an_engine_flag_with_a_default_that_fits_the_start_up_adapters():
    from pagoda.engine.cli.serve_args import engine_config_kwargs, parse_args
    from pagoda.engine.config import EngineConfig

    kwargs = engine_config_kwargs(parse_args(["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "5"]))
    assert EngineConfig(**kwargs).lora_adapter_limit == 5
    assert EngineConfig(enable_lora=True, max_loras=3).lora_adapter_limit == 3
    modules = [f"a{i}=/x" for i in range(4)]
    assert EngineConfig(enable_lora=True, lora_modules=modules).lora_adapter_limit == 4
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer of at least max_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras is below the 4 adapters of lora_modules"):
        EngineConfig(enable_lora=True, lora_modules=modules, max_cpu_loras=3)
