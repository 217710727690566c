"""HF import/export: parity with `transformers`, bit-exact round trips, clear errors."""

import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dice_jax import sharding
from dice_jax.data.byte_tokenizer import byte_model_overrides, write_byte_tokenizer
from dice_jax.data.tokenizer import TokenizerMismatchError
from dice_jax.hf import checkpoint as hf_ckpt
from dice_jax.hf.checkpoint import CheckpointError
from dice_jax.hf.parity import check_parity, torch_logits
from dice_jax.hf.safetensors_io import SafetensorsFile, save_file
from dice_jax.model import AttentionSpec, Transformer, get_config
from dice_jax.model.masks import dense_mask

TOL = 1e-4


def _save_tiny_qwen3(path, *, tie=False, dtype=torch.float32, seed=0):
  """A random tiny Qwen3 saved by transformers itself (norms perturbed so they matter)."""
  torch.manual_seed(seed)
  cfg = transformers.Qwen3Config(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    tie_word_embeddings=tie,
    initializer_range=0.15,
    max_position_embeddings=512,
  )
  model = transformers.Qwen3ForCausalLM(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  model.to(dtype).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  return str(_save_tiny_qwen3(tmp_path_factory.mktemp("qwen3")))


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_under_causal_and_block_causal_masks(tmp_path, tie):
  path = _save_tiny_qwen3(str(tmp_path / "m"), tie=tie)
  results = {r.mask: r for r in check_parity(path, batch=2, seq_len=20, block_size=4)}
  assert set(results) == {"causal", "block_causal"}
  for r in results.values():
    assert r.max_abs_logit > 1.0  # logits large enough for the comparison to mean something
    assert r.max_abs_diff <= TOL, r


def test_transformers_honours_the_block_causal_mask(hf_dir):
  """Guards the parity test: the custom 4D mask really changes transformers' output."""
  tok = np.random.default_rng(0).integers(0, 160, size=(1, 12))
  pos = jnp.arange(12)[None]
  block = np.asarray(dense_mask(AttentionSpec.block_causal(4), pos))
  causal = np.asarray(dense_mask(AttentionSpec.causal(), pos))
  a, b = torch_logits(hf_dir, tok, block), torch_logits(hf_dir, tok, causal)
  assert np.abs(a - b).max() > 1e-2
  np.testing.assert_allclose(b, torch_logits(hf_dir, tok, None), atol=1e-5)


def _tensors(path):
  out = {}
  for fn in sorted(os.listdir(path)):
    if fn.endswith(".safetensors"):
      f = SafetensorsFile(os.path.join(path, fn))
      out.update({k: np.array(f.get(k)) for k in f.keys()})
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_to_jax_to_hf_is_bit_exact_with_sharded_output(tmp_path, dtype):
  src = _save_tiny_qwen3(
    str(tmp_path / "src"), dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32
  )
  model, cfg = hf_ckpt.import_hf(src, param_dtype=dtype)
  out = hf_ckpt.export_hf(model, str(tmp_path / "out"), dtype=dtype, max_shard_bytes=40_000)
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  assert len(set(index["weight_map"].values())) > 1  # really sharded
  a, b = _tensors(src), _tensors(out)
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), k
  # and the sharded export re-imports to the same parameters
  again, _ = hf_ckpt.import_hf(out, param_dtype=dtype)
  np.testing.assert_array_equal(
    np.asarray(again.layers.q_proj[...], np.float32),
    np.asarray(model.layers.q_proj[...], np.float32),
  )


def test_export_loads_in_transformers_with_no_missing_keys_and_same_logits(tmp_path):
  cfg = get_config("tiny", dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  out = hf_ckpt.export_hf(model, str(tmp_path / "export"), dtype="float32")
  hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
    out, dtype=torch.float32, output_loading_info=True
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  cfg_json = json.load(open(os.path.join(out, "config.json")))
  assert cfg_json["architectures"] == ["Qwen3ForCausalLM"] and cfg_json["model_type"] == "qwen3"
  assert (cfg_json["block_size"], cfg_json["mask_token_id"]) == (cfg.block_size, cfg.mask_token_id)
  assert os.path.exists(os.path.join(out, "generation_config.json"))
  tok = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 10))
  ours = np.asarray(
    model(jnp.asarray(tok), jnp.broadcast_to(jnp.arange(10), (2, 10)), AttentionSpec.causal())
  )
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.as_tensor(tok)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=TOL)


def test_import_onto_an_8_device_mesh_equals_single_device(hf_dir):
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  sharded, cfg = hf_ckpt.import_hf(hf_dir, mesh, param_dtype="float32", dtype="float32")
  single, _ = hf_ckpt.import_hf(hf_dir, param_dtype="float32", dtype="float32")
  up = sharded.layers.up_proj[...]
  assert up.sharding.spec == jax.P(None, "fsdp", "tensor")
  # each device holds only its shard: 1/8 of the parameter
  assert up.addressable_shards[0].data.size * 8 == up.size
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 160, size=(4, 8)))
  pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
  spec = AttentionSpec.block_causal(4)
  got = jax.jit(lambda m, t, p: m(t, p, spec))(sharded, tok, pos)
  np.testing.assert_allclose(got, single(tok, pos, spec), atol=1e-5)


# --- bad input ---------------------------------------------------------------------------------


def _sharded_copy(src, dst):
  model, _ = hf_ckpt.import_hf(src)
  return hf_ckpt.export_hf(model, dst, dtype="float32", max_shard_bytes=40_000)


def test_missing_shard_names_the_file(hf_dir, tmp_path):
  out = _sharded_copy(hf_dir, str(tmp_path / "c"))
  (second,) = [f for f in os.listdir(out) if f.startswith("model-00002-of-")]
  os.remove(os.path.join(out, second))
  with pytest.raises(hf_ckpt.CheckpointError, match=r"model-00002-of-\d+\.safetensors is missing"):
    hf_ckpt.import_hf(out)


def test_wrong_shape_names_file_and_tensor(hf_dir, tmp_path):
  out = str(tmp_path / "bad")
  os.makedirs(out)
  tensors = _tensors(hf_dir)
  tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][
    :, :10
  ]
  save_file(tensors, os.path.join(out, "model.safetensors"))
  os.link(os.path.join(hf_dir, "config.json"), os.path.join(out, "config.json"))
  with pytest.raises(
    hf_ckpt.CheckpointError,
    match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight "
    r"has shape \(96, 10\), expected \(96, 64\)",
  ):
    hf_ckpt.import_hf(out)


def test_unsupported_dtype_names_the_tensor(hf_dir, tmp_path):
  out = str(tmp_path / "int8")
  os.makedirs(out)
  tensors = _tensors(hf_dir)
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float16)
  save_file(tensors, os.path.join(out, "model.safetensors"))
  # rewrite the dtype tag of model.norm.weight to I16 (same byte size as F16)
  raw = open(os.path.join(out, "model.safetensors"), "rb").read()
  n = int.from_bytes(raw[:8], "little")
  header = raw[8 : 8 + n].replace(
    b'"model.norm.weight":{"dtype":"F16"', b'"model.norm.weight":{"dtype":"I16"'
  )
  open(os.path.join(out, "model.safetensors"), "wb").write(raw[:8] + header + raw[8 + n :])
  os.link(os.path.join(hf_dir, "config.json"), os.path.join(out, "config.json"))
  with pytest.raises(hf_ckpt.CheckpointError, match=r"model\.norm\.weight.*unsupported dtype I16"):
    hf_ckpt.import_hf(out)


def test_unknown_config_field_names_the_file_and_field(hf_dir, tmp_path):
  out = str(tmp_path / "cfg")
  os.makedirs(out)
  hf = json.load(open(os.path.join(hf_dir, "config.json")))
  hf["num_experts"] = 64
  json.dump(hf, open(os.path.join(out, "config.json"), "w"))
  os.link(os.path.join(hf_dir, "model.safetensors"), os.path.join(out, "model.safetensors"))
  with pytest.raises(ValueError, match=r"config\.json.*num_experts=64"):
    hf_ckpt.import_hf(out)


def test_interrupted_export_leaves_nothing_behind(tmp_path, monkeypatch):
  model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
  calls = []

  def failing_save(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == 2:
      raise KeyboardInterrupt("simulated interruption")
    save_file(tensors, path, metadata)

  monkeypatch.setattr(hf_ckpt, "save_file", failing_save)
  with pytest.raises(KeyboardInterrupt):
    hf_ckpt.export_hf(model, str(tmp_path / "out"), max_shard_bytes=40_000)
  assert len(calls) == 2
  assert os.listdir(tmp_path) == []  # no out dir, no temp dir


def test_export_refuses_to_clobber_without_overwrite(tmp_path):
  model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
  out = hf_ckpt.export_hf(model, str(tmp_path / "out"))
  with pytest.raises(FileExistsError):
    hf_ckpt.export_hf(model, out)
  hf_ckpt.export_hf(model, out, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["out"]


def test_export_is_readable_by_others_under_the_usual_umask(tmp_path, umask_022):
  model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
  out = hf_ckpt.export_hf(model, str(tmp_path / "out"))
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o755  # was 0700 (tempfile.mkdtemp)
  modes = {stat.S_IMODE(os.stat(os.path.join(out, f)).st_mode) for f in os.listdir(out)}
  assert modes == {0o644}


def test_export_refuses_a_tokenizer_that_does_not_fit_the_model(tmp_path):
  """A 260-id byte tokenizer on the 256-id tiny preset: vocab, mask and eos all disagree."""
  tok_dir = write_byte_tokenizer(str(tmp_path / "byte_tok"))
  model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(TokenizerMismatchError) as e:
    hf_ckpt.export_hf(model, str(tmp_path / "out"), tokenizer_dir=tok_dir)
  msg = str(e.value)
  assert "\n" not in msg and tok_dir in msg
  assert "has 260 ids but the model's vocab_size is 256" in msg
  assert "mask id 259 (<|MASK|>) != the model's mask_token_id 255" in msg
  assert "eos ids differ" in msg
  assert sorted(os.listdir(tmp_path)) == ["byte_tok"]  # nothing written
  with pytest.raises(CheckpointError, match="no_such: no such directory"):
    hf_ckpt.export_hf(model, str(tmp_path / "out"), tokenizer_dir=str(tmp_path / "no_such"))


def test_export_with_a_fitting_tokenizer_copies_it_and_import_checks_it(tmp_path):
  tok_dir = write_byte_tokenizer(str(tmp_path / "byte_tok"))
  cfg = get_config("tiny", **byte_model_overrides())
  out = hf_ckpt.export_hf(
    Transformer(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "out"), tokenizer_dir=tok_dir
  )
  assert hf_ckpt.has_tokenizer(out)
  hf_ckpt.import_hf(out)  # its own tokenizer fits
  config = json.load(open(os.path.join(out, "config.json")))
  json.dump({**config, "mask_token_id": 7}, open(os.path.join(out, "config.json"), "w"))
  with pytest.raises(TokenizerMismatchError, match=f"import {out}: .*mask id 259"):
    hf_ckpt.import_hf(out)


def test_import_of_a_missing_directory_says_so(tmp_path):
  with pytest.raises(CheckpointError, match="nope: no such directory"):
    hf_ckpt.import_hf(str(tmp_path / "nope"))


def test_sdar_style_checkpoint_imports_with_its_block_size_and_mask_id(
  hf_dir, tmp_path, shared_data
):
  """A directory whose config.json is SDAR's (model_type sdar, auto_map, SDAR's training switches)."""
  sdar = json.loads((shared_data / "sdar_chat" / "config_4b.json").read_text())
  ours = json.load(open(os.path.join(hf_dir, "config.json")))
  for key in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
  ):
    sdar[key] = ours[key]
  sdar.update(rope_theta=10000.0, block_size=8, mask_token_id=150)
  out = tmp_path / "sdar"
  out.mkdir()
  (out / "config.json").write_text(json.dumps(sdar))
  os.link(os.path.join(hf_dir, "model.safetensors"), out / "model.safetensors")
  model, cfg = hf_ckpt.import_hf(str(out), param_dtype="float32", dtype="float32")
  assert (cfg.block_size, cfg.mask_token_id) == (8, 150)
  qwen, _ = hf_ckpt.import_hf(hf_dir, param_dtype="float32", dtype="float32")
  tok = jnp.asarray(np.random.default_rng(2).integers(0, 160, size=(1, 8)))
  pos = jnp.arange(8)[None]
  np.testing.assert_array_equal(
    model(tok, pos, AttentionSpec.causal()), qwen(tok, pos, AttentionSpec.causal())
  )
