"""drelay.config: strict loading of params.yaml, with every error naming file, section and key."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from drelay.config import (SECTIONS, ConfigError, DecodeConfig, DrafterConfig, Params, TargetConfig, flatten, load_params,
                           load_section, to_dict)

REPO_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_repo_params_yaml_loads_the_cpu_profile():
    params = load_params(REPO_PARAMS)
    assert params.target == TargetConfig(source="smollm2-gguf", dtype="float32", device="cpu")
    assert (params.drafter.block_size, params.drafter.num_context_layers) == (8, 3)
    assert params.drafter.num_layers == 1 and params.drafter.num_heads is None
    assert params.distill.temperature == 0.0 and params.distill.max_new_tokens == 192
    assert params.decode.pool_size == 8 and params.decode.sampling_rule == "residual"


def test_registry_matches_params_attributes():
    assert SECTIONS["target"] is TargetConfig and SECTIONS["drafter"] is DrafterConfig
    assert SECTIONS["decode"] is DecodeConfig
    assert [f.name for f in dataclasses.fields(Params)] == list(SECTIONS)


def test_missing_sections_and_keys_take_defaults(tmp_path):
    params = load_params(write(tmp_path, "drafter:\n  block_size: 4\n"))
    assert params.drafter == DrafterConfig(block_size=4)
    assert params.target == TargetConfig() and params.decode == DecodeConfig()
    assert load_params(write(tmp_path, "")) == Params()


def test_unknown_key_names_key_section_file_and_suggests(tmp_path):
    path = write(tmp_path, "drafter:\n  blok_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    message = str(err.value)
    assert message.startswith(f"{path}: unknown key 'blok_size' in section 'drafter'")
    assert "valid keys: num_layers, num_context_layers, block_size" in message
    assert message.endswith("did you mean 'block_size'?")


def test_unknown_key_with_no_close_match_has_no_suggestion(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'zzz' in section 'decode'") as err:
        load_params(write(tmp_path, "decode:\n  zzz: 1\n"))
    assert "did you mean" not in str(err.value)


def test_unknown_section_lists_valid_sections(tmp_path):
    path = write(tmp_path, "drafters:\n  block_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == (
        f"{path}: unknown section 'drafters' (valid sections: {', '.join(SECTIONS)}); "
        "did you mean 'drafter'?"
    )
    assert "target, drafter, decode" in str(err.value)


@pytest.mark.parametrize(
    ("yaml_value", "got"),
    [("'8'", "str ('8')"), ("true", "bool (True)"), ("8.0", "float (8.0)")],
)
def test_wrong_type_for_int_names_key_and_types(tmp_path, yaml_value, got):
    path = write(tmp_path, f"drafter:\n  block_size: {yaml_value}\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: drafter.block_size must be int, got {got}"


def test_bool_is_not_a_float_and_number_is_not_a_str(tmp_path):
    with pytest.raises(ConfigError, match=r"distill\.temperature must be float, got bool"):
        load_params(write(tmp_path, "distill:\n  temperature: false\n"))
    with pytest.raises(ConfigError, match=r"target\.dtype must be str, got int \(16\)"):
        load_params(write(tmp_path, "target:\n  dtype: 16\n"))


def test_int_is_accepted_for_float_and_converted(tmp_path):
    distill = load_params(write(tmp_path, "distill:\n  temperature: 1\n")).distill
    assert distill.temperature == 1.0 and type(distill.temperature) is float


def test_null_for_optional_and_int_or_none_type_error(tmp_path):
    path = write(tmp_path, "drafter:\n  num_heads: null\n  num_kv_heads: 3\n")
    drafter = load_params(path).drafter
    assert drafter.num_heads is None and drafter.num_kv_heads == 3
    with pytest.raises(ConfigError, match=r"drafter\.num_heads must be int \| None, got str"):
        load_params(write(tmp_path, "drafter:\n  num_heads: four\n"))
    with pytest.raises(ConfigError, match=r"drafter\.block_size must be int, got NoneType"):
        load_params(write(tmp_path, "drafter:\n  block_size: null\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("drafter:\n  block_size: 1\n", "drafter.block_size must be >= 2, got 1"),
        (
            "target:\n  dtype: fp8\n",
            "target.dtype must be one of float32, float64, bfloat16, float16, got 'fp8'",
        ),
        ("distill:\n  temperature: -1\n", "distill.temperature must be >= 0, got -1.0"),
        (
            "decode:\n  sampling_rule: greedy\n",
            "decode.sampling_rule must be residual or match, got 'greedy'",
        ),
        ("target:\n  device: gpu\n", "target.device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
        (
            "drafter:\n  num_heads: 9\n  num_kv_heads: 2\n",
            "drafter.num_kv_heads must be a divisor of num_heads (9), got 2",
        ),
    ],
)
def test_value_constraints_name_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: {message}"


def test_value_constraint_also_applies_to_direct_construction():
    with pytest.raises(ConfigError, match="pool_size must be >= 1, got 0"):
        DecodeConfig(pool_size=0)
    with pytest.raises(ConfigError, match=r"verify_size must be 0 \(the whole block\) or >= 2"):
        DecodeConfig(verify_size=1)


def test_overrides_apply_in_order_and_parse_yaml_values(tmp_path):
    path = write(tmp_path, "drafter:\n  block_size: 8\n")
    overrides = ["drafter.block_size=4", "distill.temperature=0.7", "drafter.num_heads=null", "joint.domino.rank=64"]
    params = load_params(path, overrides)
    assert params.drafter.block_size == 4 and params.distill.temperature == 0.7
    assert params.joint.domino.rank == 64 and params.joint.domino.gru_size == 256  # a nested section's key
    assert params.drafter.num_heads is None
    assert load_params(path, ["drafter.block_size=4", "drafter.block_size=6"]).drafter.block_size == 6


def test_override_errors_name_the_override(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(ConfigError) as err:
        load_params(path, ["drafter.blok_size=4"])
    assert str(err.value).startswith(
        "override 'drafter.blok_size=4': unknown key 'blok_size' in section 'drafter'"
    )
    assert str(err.value).endswith("did you mean 'block_size'?")
    with pytest.raises(ConfigError, match=r"override 'draft\.block_size=4': unknown section 'draft'"):
        load_params(path, ["draft.block_size=4"])
    bad = r"override 'drafter\.block_size=1': drafter\.block_size must be >= 2, got 1"
    with pytest.raises(ConfigError, match=bad):
        load_params(path, ["drafter.block_size=1"])
    with pytest.raises(ConfigError, match=r"override 'block_size=4' must look like section\.key=value"):
        load_params(path, ["block_size=4"])


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=re.escape(f"params file not found: {path}")):
        load_params(path)


def test_non_mapping_top_level_and_section(tmp_path):
    path = write(tmp_path, "- drafter\n- decode\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: top level must be a mapping of sections, got list"
    path = write(tmp_path, "drafter: 8\n")
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: section 'drafter' must be a mapping, got int (8)"


def test_load_section_checks_only_its_own_keys_but_all_section_names(tmp_path):
    path = write(tmp_path, "drafter:\n  block_size: 4\ndecode:\n  bogus: 1\n")
    assert load_section(path, "drafter") == DrafterConfig(block_size=4)
    with pytest.raises(ConfigError, match="unknown key 'bogus' in section 'decode'"):
        load_section(path, "decode")
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        load_section(path, "trian")
    with pytest.raises(ConfigError, match="unknown section 'evals'"):
        load_section(write(tmp_path, "evals: {}\n"), "drafter")


def test_params_are_frozen():
    params = load_params(REPO_PARAMS)
    frozen = dataclasses.FrozenInstanceError
    with pytest.raises(frozen, match="cannot assign to field 'block_size'"):
        params.drafter.block_size = 4
    with pytest.raises(frozen, match="cannot assign to field 'drafter'"):
        params.drafter = DrafterConfig()


def test_to_dict_and_flatten_round_trip():
    params = load_params(REPO_PARAMS)
    nested = to_dict(params)
    assert nested["drafter"]["block_size"] == 8 and set(nested) == set(SECTIONS)
    flat = flatten(nested)
    assert flat["drafter.block_size"] == 8 and flat["decode.sampling_rule"] == "residual"
    def leaves(cls) -> int:  # a nested section (joint.common, joint.drelay, ...) counts its own keys
        hints = typing.get_type_hints(cls)
        return sum(leaves(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else 1
                   for f in dataclasses.fields(cls))

    assert len(flat) == sum(leaves(cls) for cls in SECTIONS.values())
    assert flat["joint.domino.rank"] == params.joint.domino.rank
    assert flat["joint.common.extra_steps"] == params.joint.common.extra_steps


def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "drafter:\n  block_size: [8\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid YAML")):
        load_params(path)


def test_eval_per_benchmark_mappings(tmp_path):
    path = write(tmp_path, "eval:\n  samples: {default: 16, aime24: 8}\n  live_samples: {default: 0}\n")
    cfg = load_params(path).eval
    assert cfg.per_benchmark("samples", "aime24") == 8 and cfg.per_benchmark("samples", "gsm8k") == 16
    assert cfg.per_benchmark("live_samples", "mbpp") == 0
    cases = {
        "eval:\n  samples: 16\n": "eval.samples must be mapping of int, got int (16)",
        "eval:\n  samples: {gsm8k: x}\n": "eval.samples.gsm8k must be int, got str ('x')",
        "eval:\n  samples: {gsm8k: 4}\n": "eval.samples must be set for every benchmark (or a 'default' entry)",
        "eval:\n  samples: {default: 4, gsm8: 4}\n": "eval.samples must be a mapping from benchmark names",
        "eval:\n  samples: {default: 0}\n": "eval.samples.default must be >= 1, got 0",
        "eval:\n  methods: [ar, medusa]\n": "eval.methods must be a non-empty list of distinct names from ar, dflash",
        "eval:\n  temperatures: [0.0, 0.0]\n": "eval.temperatures must be a non-empty list of distinct values >= 0",
        "eval:\n  oracle_drafter: oracle\n": "eval.oracle_drafter must be one of dflash",
    }
    _expect_errors(tmp_path, cases)
    narrow = write(tmp_path, "eval:\n  benchmarks: [gsm8k]\n  samples: {gsm8k: 4}\n")
    assert load_params(narrow).eval.samples == {"gsm8k": 4}  # only the listed benchmarks need an entry


def _expect_errors(tmp_path, cases: dict[str, str]) -> None:
    """Each params text fails to load with its message."""
    for text, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_params(write(tmp_path, text))


def test_data_mix_and_writer_errors_name_the_key(tmp_path):
    cfg = load_params(write(tmp_path, "data:\n  mix: {math: 0.5, code: 0.5, chat: 0.0}\n"
                                      "  writer: {prompts: {code: 4}, temperature: 1.0}\n")).data
    assert cfg.mix.shares() == {"math": 0.5, "code": 0.5, "chat": 0.0} and cfg.writer.prompts.counts()["code"] == 4
    assert cfg.writer.total == 4 and load_params(write(tmp_path, "")).data.writer.total == 0
    cases = {
        "data:\n  mix: {math: 0.5, code: 0.3, chat: 0.3}\n": "data.mix must be shares that sum to 1",
        "data:\n  mix: {math: 1.2, code: -0.2, chat: 0.0}\n": "data.mix.code must be >= 0, got -0.2",
        "data:\n  mix: {maths: 0.4}\n": "unknown key 'maths' in section 'data.mix'",
        "data:\n  train_sources: [gsm8k, mbpp]\n": "data.mix.chat must be 0 when no source gives chat prompts",
        "data:\n  writer: {temperature: 0}\n": "data.writer.temperature must be > 0",
        "data:\n  writer: {prompts: {chat: -1}}\n": "data.writer.prompts.chat must be >= 0, got -1",
        "data:\n  near_dup_threshold: 0\n": "data.near_dup_threshold must be in (0, 1]",
    }
    _expect_errors(tmp_path, cases)
    # a chat share with no chat source is fine once the target writes chat prompts
    ok = "data:\n  train_sources: [gsm8k, mbpp]\n  writer: {prompts: {chat: 8}}\n"
    assert load_params(write(tmp_path, ok)).data.writer.prompts.chat == 8
