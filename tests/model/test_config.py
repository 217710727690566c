"""Config presets, validation and HF config conversion."""

import json

import pytest

from dice_jax.model.config import PRESETS, from_hf_config, get_config, to_hf_config


@pytest.mark.parametrize(
  "name,fname", [("sdar_4b", "config_4b.json"), ("sdar_8b", "config_8b.json")]
)
def test_presets_equal_sdar_configs(shared_data, name, fname):
  hf = json.loads((shared_data / "sdar_chat" / fname).read_text())
  assert from_hf_config(hf) == get_config(name)


def test_sdar_1p7b_has_qwen3_1p7b_dimensions():
  c = get_config("sdar_1p7b")
  assert (
    c.num_layers,
    c.hidden_size,
    c.num_heads,
    c.num_kv_heads,
    c.head_dim,
    c.intermediate_size,
    c.vocab_size,
    c.tie_word_embeddings,
  ) == (28, 2048, 16, 8, 128, 6144, 151936, False)
  assert 2.0e9 < c.num_params() < 2.1e9  # SDAR-1.7B's 4.06 GB bf16 file: ~2.03B parameters


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
  cfg = get_config(name)
  assert from_hf_config(to_hf_config(cfg)) == cfg


def test_unknown_non_default_hf_field_is_an_error_naming_it():
  hf = to_hf_config(get_config("tiny"))
  hf["moe_num_experts"] = 8
  with pytest.raises(ValueError, match="moe_num_experts"):
    from_hf_config(hf, source="x/config.json")
  hf["moe_num_experts"] = None  # an unknown field at a default value changes nothing
  assert from_hf_config(hf) == get_config("tiny")


@pytest.mark.parametrize(
  "field,value",
  [
    ("attention_bias", True),
    ("hidden_act", "gelu"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}),
  ],
)
def test_unimplemented_architecture_variants_are_refused(field, value):
  hf = to_hf_config(get_config("tiny"))
  hf[field] = value
  with pytest.raises(ValueError, match=field):
    from_hf_config(hf)


def test_invalid_values_are_rejected_on_construction():
  with pytest.raises(ValueError, match="num_kv_heads"):
    get_config("tiny", num_kv_heads=3)
  with pytest.raises(ValueError, match="mask_token_id"):
    get_config("tiny", mask_token_id=999)
  with pytest.raises(ValueError, match="unknown model preset"):
    get_config("gpt5")
  with pytest.raises(ValueError, match="model_type"):
    from_hf_config({"model_type": "llama"})


def test_flash_tiles_are_validated_and_json_lists_become_tuples():
  with pytest.raises(ValueError, match="flash_tiles must be three positive ints"):
    get_config("tiny", flash_tiles=(128, 0, 64))
  cfg = get_config("tiny", flash_tiles=[64, 32, 32], eos_token_id=[1, 2])  # as read from JSON
  assert cfg.flash_tiles == (64, 32, 32) and cfg.eos_token_id == (1, 2)
  hash(cfg)  # a static module attribute must hash
