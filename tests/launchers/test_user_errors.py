"""The launchers as a user runs them (subprocesses): a wrong input gets one line naming it, exit
status 2, no traceback, and nothing written; long work shows progress."""

import json
import os
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

from dice_jax.data.byte_tokenizer import write_byte_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_SETS = ["--set=data_source=cuke", "--set=seq_len=256", "--set=batch_size=4"]


def launch(module, *args, timeout=300, platforms="cpu"):
  """`python -m experiments.<module> args` with JAX_PLATFORMS=`platforms` (None: unset)."""
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
    JAX_PLATFORMS="cpu",
  )
  if platforms is None:
    del env["JAX_PLATFORMS"]
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(
    [sys.executable, "-m", f"experiments.{module}", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def error_line(proc, launcher: str) -> str:
  """The launcher's one error line; asserts exit status 2, no traceback, and that it is last."""
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert [x for x in lines if x.startswith(f"{launcher}: error: ")] == lines[-1:], lines[-5:]
  return lines[-1]


def tree(path) -> dict:
  """{relative path: (size, mtime)} of everything under `path`."""
  out = {}
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      p = os.path.join(root, name)
      out[os.path.relpath(p, path)] = (os.path.getsize(p), os.path.getmtime(p))
  return out


@pytest.fixture(scope="module")
def cuke_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "cuke.jsonl"
  rows = [
    {"prompt": f"Write a relu kernel #{i}.", "response": "__global__ void k() {}"} for i in range(8)
  ]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory):
  return write_byte_tokenizer(str(tmp_path_factory.mktemp("tok") / "byte"))


def test_sft_with_an_empty_data_file(tmp_path):
  data = tmp_path / "empty.jsonl"
  data.write_text("")
  workdir = tmp_path / "run"
  proc = launch("sft", f"--workdir={workdir}", f"--set=data_path={data}", *SFT_SETS)
  assert error_line(proc, "sft") == (
    f"sft: error: {data}: no SFT samples (the file is empty or has no valid cuke rows)"
  )
  assert not workdir.exists()  # was: model_config.json and tokenizer/ left behind


def test_sft_with_a_missing_data_file_or_a_bad_override(tmp_path):
  workdir = tmp_path / "run"
  proc = launch("sft", f"--workdir={workdir}", f"--set=data_path={tmp_path}/no.jsonl", *SFT_SETS)
  assert error_line(proc, "sft") == f"sft: error: {tmp_path}/no.jsonl: file not found"
  proc = launch("sft", f"--workdir={workdir}", "--set=seq_len=25x")
  assert error_line(proc, "sft") == "sft: error: override seq_len: expected int, got '25x'"
  assert not workdir.exists()


def test_sft_refuses_an_rl_config_and_names_a_bad_data_line_counting_from_1(tmp_path):
  workdir = tmp_path / "run"
  proc = launch("sft", f"--workdir={workdir}", "--config=rl_tiny")  # was an AttributeError
  assert error_line(proc, "sft").startswith(
    "sft: error: --config rl_tiny is an RL config (for `python -m experiments.rl`); "
    "experiments.sft takes one of ['sdar_1p7b', "
  )
  data = tmp_path / "cuke.jsonl"
  data.write_text('{"prompt": "p", "response": "r"}\n{"prompt": 3, "response": "r"}\n')
  proc = launch("sft", f"--workdir={workdir}", f"--set=data_path={data}", *SFT_SETS)
  assert error_line(proc, "sft") == (  # was "row 1", where `verifier check` says line 2
    f"sft: error: {data}:2: field 'prompt' must be a string, got int"
  )
  assert not workdir.exists()


def test_sft_with_incomplete_or_inconsistent_multi_process_flags(tmp_path, cuke_file):
  workdir = tmp_path / "run"
  sets = [f"--workdir={workdir}", f"--set=data_path={cuke_file}", *SFT_SETS]
  proc = launch("sft", *sets, "--num_processes=2", "--process_id=0")
  assert error_line(proc, "sft") == (
    "sft: error: --num_processes/--process_id need --coordinator_address (or --distributed)"
  )
  proc = launch(
    "sft", *sets, "--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"
  )
  line = error_line(proc, "sft")
  assert (
    line.startswith(
      "sft: error: jax.distributed.initialize (coordinator_address=127.0.0.1:1, num_processes=2, "
      "process_id=2): "
    )
    and "process_id < num_processes" in line
  )
  assert not workdir.exists()


def test_sft_with_a_tokenizer_that_does_not_fit_the_model(tmp_path, cuke_file, byte_tokenizer_dir):
  workdir = tmp_path / "run"
  proc = launch(
    "sft",
    f"--workdir={workdir}",
    f"--set=data_path={cuke_file}",
    f"--set=run.tokenizer={byte_tokenizer_dir}",  # a directory: no byte-model overrides
    *SFT_SETS,
  )
  line = error_line(proc, "sft")
  assert line.startswith(f"sft: error: sft (tokenizer={byte_tokenizer_dir}, model=tiny): ")
  assert "has 260 ids but the model's vocab_size is 256" in line and "mask id 259" in line
  assert not workdir.exists()
  proc = launch(
    "sft",
    f"--workdir={workdir}",
    f"--set=data_path={cuke_file}",
    f"--set=run.tokenizer={tmp_path}/nope",
    *SFT_SETS,
  )
  assert f"run.tokenizer {tmp_path}/nope: no such directory" in error_line(proc, "sft")


@pytest.fixture
def finished_run(tmp_path, cuke_file):
  """A run directory whose checkpoint (step 4) holds the config of `SFT_SETS` + `cuke_file`."""
  from dice_jax.train.checkpoint import Checkpointer
  from dice_jax.train.config import apply_overrides
  from experiments.configs.tiny import get_config

  sets = [s.removeprefix("--set=") for s in SFT_SETS] + [f"data_path={cuke_file}"]
  cfg = apply_overrides(get_config(), sets)
  workdir = tmp_path / "run"
  ckpt = Checkpointer(str(workdir / "checkpoints"), save_every=1, async_save=False)
  ckpt.save(4, {"x": np.zeros(2, np.float32)}, {}, cfg.to_json(), force=True)
  ckpt.close()
  return workdir


def test_sft_resume_with_another_config_is_refused_naming_each_field(finished_run, cuke_file):
  before = tree(finished_run)
  proc = launch(
    "sft",
    f"--workdir={finished_run}",
    f"--set=data_path={cuke_file}",
    *SFT_SETS,
    "--set=seq_len=512",
    "--set=batch_size=2",
  )
  assert error_line(proc, "sft") == (
    f"sft: error: {finished_run} holds a run (step 4) started with another config: "
    "batch_size 4 -> 2, seq_len 256 -> 512; pass --allow_config_change to continue it with the "
    "new values, or use a new --workdir"
  )
  assert tree(finished_run) == before


def _damage_every_step(workdir):
  for step in os.listdir(workdir / "checkpoints"):
    (workdir / "checkpoints" / step / "state" / "_METADATA").write_text('{"tree_metadata": {')


def test_a_run_whose_every_checkpoint_is_damaged_is_one_error_for_sft_export_and_rl(
  finished_run, cuke_file, tmp_path
):
  """Every step damaged: resume, export and --init_checkpoint name each step in one line, exit 2
  (a damaged newest step alone falls back: tests/train/test_launcher_resume.py)."""
  from dice_jax.model.config import get_config
  from dice_jax.train.checkpoint import save_model_config

  save_model_config(get_config("tiny"), str(finished_run))
  _damage_every_step(finished_run)
  before = tree(finished_run)
  damaged = (
    f"no intact checkpoint in {finished_run}/checkpoints: step 4: state/_METADATA is unreadable: "
    "JSONDecodeError: Expecting property name enclosed in double quotes"
  )
  proc = launch("sft", f"--workdir={finished_run}", f"--set=data_path={cuke_file}", *SFT_SETS)
  assert error_line(proc, "sft").startswith(f"sft: error: {damaged}")
  proc = launch(
    "export_hf", "--init=checkpoint", f"--workdir={finished_run}", f"--out={tmp_path}/x"
  )
  assert error_line(proc, "export_hf").startswith(f"export_hf: error: {damaged}")
  assert "Event loop is closed" not in proc.stderr and not (tmp_path / "x").exists()
  rl = tmp_path / "rl"
  proc = launch(
    "rl", f"--workdir={rl}", f"--init_checkpoint={finished_run}", "--verifier=127.0.0.1:1"
  )
  assert error_line(proc, "rl").startswith(f"rl: error: {damaged}")
  assert tree(finished_run) == before
  empty = tmp_path / "no_checkpoints"
  empty.mkdir()
  proc = launch("rl", f"--workdir={rl}", f"--init_checkpoint={empty}", "--verifier=127.0.0.1:1")
  assert error_line(proc, "rl") == (
    f"rl: error: run.init_checkpoint {empty}: no checkpoint under {empty}/checkpoints"
  )
  assert not rl.exists()


@pytest.fixture
def rl_run(tmp_path):
  """An RL run directory whose checkpoint (step 3) holds the config of `rl_tiny` as is."""
  from dice_jax.train.checkpoint import Checkpointer
  from experiments.configs.rl_tiny import get_config

  workdir = tmp_path / "rl"
  ckpt = Checkpointer(str(workdir / "checkpoints"), save_every=1, async_save=False)
  ckpt.save(3, {"x": np.zeros(2, np.float32)}, {"rl_step": 3}, get_config().to_json(), force=True)
  ckpt.close()
  return workdir


def test_rl_resume_refuses_a_changed_learning_rate_and_a_changed_group_size(rl_run):
  """Was: a changed learning rate only warned (naming sections) and trained on; a changed group
  size crashed in grain (`next_index 256 is out of range`). The config is checked before the run
  waits for its verifier; training longer passes the check (and then waits)."""
  before = tree(rl_run)
  args = [f"--workdir={rl_run}", "--verifier=127.0.0.1:1", "--verifier_wait_s=1"]
  proc = launch("rl", *args, "--set=stream.num_steps=20", "--set=run.checkpoint_every=5")
  changes = "run.checkpoint_every 1 -> 5, stream.num_steps 12 -> 20"
  assert f"resuming step 3 with config changes: {changes}" in proc.stderr
  assert error_line(proc, "rl").startswith("rl: error: verifier not ready after 1 s: 127.0.0.1:1")
  proc = launch("rl", *args, "--set=optim.learning_rate=0.5")
  assert error_line(proc, "rl") == (
    f"rl: error: {rl_run} holds a run (step 3) started with another config: "
    "optim.learning_rate 0.0001 -> 0.5; pass --allow_config_change to continue it with the new "
    "values, or use a new --workdir"
  )
  proc = launch("rl", *args, "--set=stream.group_size=4", "--allow_config_change")
  assert error_line(proc, "rl") == (
    f"rl: error: {rl_run} holds a run (step 3) whose config cannot change in these fields, even "
    "with --allow_config_change: stream.group_size 8 -> 4 (the saved RL-stream position counts "
    "samples of this layout); use a new --workdir"
  )
  assert tree(rl_run) == before


def test_sft_rerun_with_an_existing_export_says_what_to_do(finished_run, cuke_file, tmp_path):
  export = tmp_path / "export"
  export.mkdir()
  before = tree(tmp_path)
  proc = launch(
    "sft",
    f"--workdir={finished_run}",
    f"--set=data_path={cuke_file}",
    *SFT_SETS,
    f"--export_hf={export}",
  )
  line = error_line(proc, "sft")
  assert line.startswith(f"sft: error: export_hf {export} already exists: remove it or choose")
  assert "overwrite=True" not in line and "python -m experiments.export_hf" in line
  assert tree(tmp_path) == before


def test_export_refuses_a_tokenizer_that_does_not_fit(tmp_path, byte_tokenizer_dir):
  out = tmp_path / "out"
  proc = launch(
    "export_hf", "--init=random", f"--tokenizer_dir={byte_tokenizer_dir}", f"--out={out}"
  )
  line = error_line(proc, "export_hf")
  assert line.startswith(f"export_hf: error: export with tokenizer {byte_tokenizer_dir}: ")
  assert "vocab_size is 256" in line and "mask_token_id 255" in line and "eos ids differ" in line
  proc = launch("export_hf", "--init=random", f"--tokenizer_dir={tmp_path}/none", f"--out={out}")
  assert error_line(proc, "export_hf") == (
    f"export_hf: error: --tokenizer_dir {tmp_path}/none: no such directory"
  )
  assert os.listdir(tmp_path) == []


def test_export_names_an_unknown_model_preset(tmp_path):
  proc = launch("export_hf", "--init=random", "--config=huge", f"--out={tmp_path}/out")
  assert error_line(proc, "export_hf") == (  # was a traceback
    "export_hf: error: --config: unknown model preset 'huge'; known: ['sdar_1p7b', 'sdar_4b', "
    "'sdar_8b', 'tiny']"
  )
  assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def random_export(tmp_path_factory):
  """`export_hf --init=random` without a tokenizer, under the usual umask, with JAX_PLATFORMS unset
  (JAX then tries every backend it knows, TPU included)."""
  out = tmp_path_factory.mktemp("export") / "tiny_hf"
  old = os.umask(0o022)
  try:
    proc = launch("export_hf", "--init=random", "--config=tiny", f"--out={out}", platforms=None)
  finally:
    os.umask(old)
  return proc, out


def test_random_export_says_it_has_no_tokenizer_and_is_readable(random_export):
  proc, out = random_export
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"wrote {out} WITHOUT a tokenizer (pass --tokenizer_dir=DIR" in proc.stderr
  assert "Unable to initialize backend 'tpu'" not in proc.stderr  # nobody asked for a TPU
  assert "TPU_ACCELERATOR_TYPE" not in proc.stderr  # nor libtpu's warnings, where it is installed
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o755  # was 0700
  assert {stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)} == {0o644}
  proc = launch("export_hf", "--init=random", f"--out={out}")
  assert error_line(proc, "export_hf") == (
    f"export_hf: error: --out {out} already exists (pass --overwrite to replace it)"
  )


def test_generate_names_a_missing_directory_or_tokenizer(tmp_path, random_export):
  proc = launch("generate", f"--hf_dir={tmp_path}/nope", "--prompt=hi")
  assert (
    error_line(proc, "generate") == f"generate: error: --hf_dir {tmp_path}/nope: no such directory"
  )
  out = random_export[1]
  proc = launch("generate", f"--hf_dir={out}", "--prompt=hi")
  assert error_line(proc, "generate") == (
    f"generate: error: --prompt needs a tokenizer and {out} has none: pass --tokenizer_dir=DIR, "
    "or the prompt as --prompt_ids=1,2,3"
  )


def test_generate_refuses_a_tokenizer_that_does_not_fit(random_export, byte_tokenizer_dir):
  out = random_export[1]
  proc = launch(
    "generate", f"--hf_dir={out}", f"--tokenizer_dir={byte_tokenizer_dir}", "--prompt=hi"
  )
  line = error_line(proc, "generate")
  assert line.startswith(f"generate: error: generate --tokenizer_dir={byte_tokenizer_dir}: ")
  assert "does not match the model" in line


def test_build_cuke_names_an_unreachable_verifier(tmp_path):
  with socket.socket() as s:  # a bound port nobody listens on: connections are refused
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
    proc = launch(
      "build_cuke",
      f"--pairs={REPO}/experiments/demo_data/pairs.jsonl",
      f"--verifier={address}",
      f"--out={tmp_path}/cuke",
      "--verifier_wait_s=1",
    )
  line = error_line(proc, "build_cuke")
  assert line.startswith(f"build_cuke: error: --verifier {address}: verifier not ready after 1 s: ")
  assert line.endswith(
    "is `python -m verifier serve` running there? (--verifier_wait_s waits longer)"
  )
  assert f"waiting for the verifier at {address}: 0 s of 1 s (--verifier_wait_s)" in proc.stderr
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "launcher, args, line",
  [
    (
      "show_data",
      ["--pipeline=infill", "--infill_tasks={tmp}/junk.jsonl", "--tokenizer={tok}"],
      "{tmp}/junk.jsonl: no tasks (1 bad rows skipped)",
    ),
    (
      "export_tpu",
      ["--configs=huge"],
      "--configs: unknown model preset(s) ['huge']; known: ['sdar_1p7b', 'sdar_4b', 'sdar_8b', "
      "'tiny']",
    ),
  ],
)
def test_other_bad_inputs_that_used_to_end_in_a_traceback(
  tmp_path, byte_tokenizer_dir, launcher, args, line
):
  (tmp_path / "junk.jsonl").write_text("not json\n")
  fill = lambda s: s.format(tmp=tmp_path, tok=byte_tokenizer_dir)  # noqa: E731
  proc = launch(launcher, *map(fill, args))
  assert error_line(proc, launcher) == f"{launcher}: error: {fill(line)}"


def test_generate_refuses_sampler_settings_before_loading_the_model(random_export):
  proc = launch("generate", f"--hf_dir={random_export[1]}", "--prompt_ids=1,2", "--steps=0")
  assert error_line(proc, "generate") == (  # was a ValueError traceback
    "generate: error: SamplerConfig.steps must be >= 1, got 0"
  )
  assert "loaded" not in proc.stderr


def test_show_data_shows_progress_while_tokenising(tmp_path, byte_tokenizer_dir):
  tasks = tmp_path / "e2e.json"
  code = "import torch\nclass Model(torch.nn.Module):\n  def forward(self, x):\n    return x\n"
  tasks.write_text(json.dumps([{"pytorch_code": code, "level": 1, "idx": i} for i in range(3)]))
  proc = launch(
    "show_data",
    "--pipeline=e2e",
    "--n=0",
    f"--tokenizer={byte_tokenizer_dir}",
    f"--e2e_tasks={tasks}",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"loading the tokenizer from {byte_tokenizer_dir}" in proc.stdout
  assert "tokenising prompts: 100%" in proc.stderr and "3/3" in proc.stderr
  assert "prompt tokens over all 3 tasks" in proc.stdout
