"""`experiments.export_hf --init=checkpoint`: an SFT run's checkpoint -> the same HF export."""

import os
import pathlib

import numpy as np

from dice_jax.hf.safetensors_io import SafetensorsFile
from dice_jax.train.config import SFTConfig
from dice_jax.train.run_config import RunConfig
from dice_jax.train.checkpoint import restore_model
from dice_jax.train.loop import run_sft
from dice_jax.hf.checkpoint import export_hf

PAIRS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "demo_data" / "pairs.jsonl"


def _tensors(path):
  f = SafetensorsFile(os.path.join(path, "model.safetensors"))
  return {k: np.array(f.get(k)) for k in f.keys()}


def test_checkpoint_restores_to_the_parameters_the_run_exported(tmp_path):
  cfg = SFTConfig(
    run=RunConfig(model="tiny", model_overrides={"dtype": "float32"}, checkpoint_every=1),
    data_source="pairs",
    data_path=str(PAIRS),
    max_prompt_chars=96,
    max_response_chars=96,
    seq_len=256,
    batch_size=8,
    num_steps=2,
    log_every=1,
  )
  workdir = str(tmp_path / "run")
  run_sft(cfg, workdir, export_hf=str(tmp_path / "from_run"))
  model, tok_dir, step = restore_model(workdir)
  assert step == 2 and os.path.exists(os.path.join(tok_dir, "vocab.json"))
  export_hf(model, str(tmp_path / "from_ckpt"), tokenizer_dir=tok_dir)
  a, b = _tensors(tmp_path / "from_run"), _tensors(tmp_path / "from_ckpt")
  assert sorted(a) == sorted(b) and len(a) > 0
  for k in a:
    assert a[k].tobytes() == b[k].tobytes(), k
  assert os.path.exists(tmp_path / "from_ckpt" / "vocab.json")
