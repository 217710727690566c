"""Candidate sources: DICE's evaluation decoding, the chat-template prompt, known-candidate files."""

import json

import pytest

from dice_jax.data import prompts
from dice_jax.data.tasks import KernelTask
from dice_jax.data.code_extraction import extract as extract_candidate
from dice_jax.eval.candidates import EvalDecoding, FileCandidates

REFERENCE = (
  "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
)


def _task(pid, level=1):
  return KernelTask(f"kernelbench/L{level}/{pid}", level, REFERENCE, name=f"{pid}_Identity")


def test_default_decoding_is_dices_evaluation_decoding():
  from dice_jax.model.config import get_config

  cfg = EvalDecoding().sampler_config(stop_ids=(7, 8), pad_id=0)
  assert (cfg.block_size, cfg.steps, cfg.strategy) == (0, 4, "low_confidence_static")
  assert cfg.for_model(get_config("sdar_1p7b")).block_size == 4  # 0: the model's (SDAR: 4)
  assert (cfg.temperature, cfg.top_k, cfg.top_p) == (0.0, 0, 1.0)  # greedy
  assert cfg.confidence == "unfiltered"  # as SDAR's evaluation decoder ranks positions
  assert (cfg.max_new_tokens, cfg.block_alignment, cfg.stop_ids) == (4096, "absolute", (7, 8))
  assert EvalDecoding().max_prompt_tokens == 4096  # DICE: truncation=True, max_length=4096
  with pytest.raises(ValueError, match="max_prompt_tokens must be >= 0"):
    EvalDecoding(max_prompt_tokens=-1)


def test_confidence_reaches_the_sampler():
  assert EvalDecoding().sampler_config((), 0).confidence == "unfiltered"
  # DICE's literal settings (temperature 1, top-k 1) ranked by the filtered distribution
  dice = EvalDecoding(temperature=1.0, top_k=1, confidence="filtered").sampler_config((), 0)
  assert (dice.temperature, dice.top_k, dice.confidence) == (1.0, 1, "filtered")
  with pytest.raises(ValueError, match="confidence must be"):
    EvalDecoding(confidence="raw")


def test_candidate_is_the_first_fenced_block():
  resp = "Here:\n```python\nclass ModelNew: pass\n```\nand\n```cpp\nint x;\n```"
  assert extract_candidate(resp) == "class ModelNew: pass"
  assert extract_candidate("no fences") is None
  assert extract_candidate("no fences", "first_block_or_raw") == "no fences"
  assert extract_candidate("  ", "first_block_or_raw") is None


@pytest.mark.slow  # ~15 s of CPU (a sampler compile over a 2.8k-token canvas)
def test_model_prompt_is_the_one_shot_prompt_in_the_chat_template(tmp_path):
  from flax import nnx

  from dice_jax.data.byte_tokenizer import byte_model_overrides, write_byte_tokenizer
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.eval.candidates import ModelCandidates
  from dice_jax.model import Transformer, get_config

  tok = Tokenizer.from_dir(write_byte_tokenizer(str(tmp_path / "tok")))
  model = Transformer(get_config("tiny", **byte_model_overrides()), rngs=nnx.Rngs(0))
  src = ModelCandidates(model, tok, EvalDecoding(max_new_tokens=8), batch_size=2)
  chat = tok.apply_chat_template([{"role": "user", "content": prompts.e2e_user_message(REFERENCE)}])
  assert chat.startswith("<|im_start|>user\nYou write custom CUDA kernels")
  assert src.prompt_ids(_task(1)) == tok.encode(chat)
  gens = src.generate([(_task(1), 0)])  # one row, padded to the batch of 2
  assert len(gens) == 1 and 1 <= gens[0].response_tokens <= 8
  assert gens[0].prompt_tokens == len(tok.encode(chat)) and gens[0].seconds > 0
  assert "<|MASK|>" not in gens[0].response
  wrong = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))  # 256 tokens, mask id 255
  with pytest.raises(ValueError, match="eval: .* does not match the model: .*mask id"):
    ModelCandidates(wrong, tok, EvalDecoding())


def test_a_long_prompt_keeps_its_first_tokens_as_dices_evaluation_tokenizes(tmp_path):
  """DICE tokenizes with `truncation=True, max_length=4096` and the default right side: a longer
  prompt loses its end (the assistant header too); 0 keeps it whole."""
  from flax import nnx

  from dice_jax.data.byte_tokenizer import byte_model_overrides, write_byte_tokenizer
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.eval.candidates import ModelCandidates
  from dice_jax.model import Transformer, get_config

  tok = Tokenizer.from_dir(write_byte_tokenizer(str(tmp_path / "tok")))
  model = Transformer(get_config("tiny", **byte_model_overrides()), rngs=nnx.Rngs(0))
  full = ModelCandidates(model, tok, EvalDecoding(max_prompt_tokens=0)).prompt_ids(_task(1))
  assert len(full) > 1000 and tok.decode(full).endswith("<|im_start|>assistant\n")
  cut = ModelCandidates(model, tok, EvalDecoding(max_prompt_tokens=1000)).prompt_ids(_task(1))
  assert cut == full[:1000]
  assert "<|im_start|>assistant" not in tok.decode(cut)
  whole = ModelCandidates(model, tok, EvalDecoding(max_prompt_tokens=len(full)))
  assert whole.prompt_ids(_task(1)) == full


def test_file_candidates_by_task_id_or_level_and_problem_id(tmp_path):
  rows = [
    {"task_id": "kernelbench/L1/1", "candidate": "A"},
    {"level": 1, "problem_id": 2, "sample": 1, "response": "x\n```python\nB\n```"},
    {"level": 1, "problem_id": 3, "response": "no code"},
    {"level": 2, "problem_id": 1, "candidate": "outside the run"},
  ]
  path = tmp_path / "c.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  src = FileCandidates(str(path), [_task(1), _task(2), _task(3)])
  gens = src.generate([(_task(1), 0), (_task(2), 1), (_task(3), 0), (_task(2), 0)])
  assert [g and g.candidate for g in gens] == ["A", "B", None, None]
  assert gens[2] is not None and gens[3] is None  # no code block vs. no candidate at all
  path.write_text('{"level": 1}\n')
  with pytest.raises(ValueError, match=r"c.jsonl:1: expected"):
    FileCandidates(str(path), [_task(1)])


@pytest.mark.slow  # a 10M-parameter model (SDAR's 151,936-token embedding) decoding a real prompt
def test_kernelbench_prompt_with_the_sdar_tokenizer(shared_data):
  from flax import nnx

  from dice_jax.data.tasks import load_kernelbench
  from dice_jax.data.tokenizer import Tokenizer
  from dice_jax.eval.candidates import ModelCandidates
  from dice_jax.model import Transformer, get_config

  tok = Tokenizer.from_dir(shared_data / "sdar_chat")
  task = [
    t for t in load_kernelbench(str(shared_data / "kernelbench"), [1])[0] if t.name == "19_ReLU"
  ][0]
  cfg = get_config(
    "tiny",
    vocab_size=151936,
    mask_token_id=tok.mask_token_id,
    eos_token_id=151643,
    pad_token_id=None,
  )
  src = ModelCandidates(Transformer(cfg, rngs=nnx.Rngs(0)), tok, EvalDecoding(max_new_tokens=8), 1)
  message = prompts.e2e_user_message(task.reference_code)
  # DICE's evaluation: the SDAR chat template around the KernelBench one-shot message
  rendered = f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template([{"role": "user", "content": message}]) == rendered
  assert src.prompt_ids(task) == tok.encode(rendered)
  (gen,) = src.generate([(task, 0)])
  assert gen.prompt_tokens == len(tok.encode(rendered)) and 1 <= gen.response_tokens <= 8
  assert "<|MASK|>" not in gen.response


def test_known_gpu_candidates_and_their_expected_metrics(shared_data, tmp_path):
  import ast

  from experiments import eval_known

  out = tmp_path / "known.jsonl"
  eval_known.write(str(shared_data / "kernelbench"), list(range(19, 33)), str(out))
  rows = {r["problem_id"]: r["candidate"] for r in map(json.loads, out.read_text().splitlines())}
  assert sorted(rows) == [19, 20, 21, 22] + list(range(24, 33))  # 23 has no candidate
  for pid, src in rows.items():
    assert "class ModelNew(nn.Module)" in src and "class Model(" not in src
    ast.parse(src)  # the Python side of every candidate is valid (22's error is in the CUDA)
  assert "tanhf(v)\n" in rows[22] and "acc = fmaf(acc, 0.999f, v);" in rows[21]
  want = json.loads((tmp_path / "known.expected.json").read_text())
  assert want["compile_rate"] == 12 / 14 and want["exec_accuracy"] == 11 / 14
  assert want["fast_p"] == {"0": 11 / 14, "0.5": 10 / 14, "1.5": 0.0, "2": 0.0}
  assert want["failure_kinds"] == {"OK": 11, "WRONG_OUTPUT": 1, "COMPILE_ERROR": 1, "MISSING": 1}
  # check() against a run whose metrics say exactly that, then one that differs
  run = tmp_path / "run"
  run.mkdir()
  got = dict(want, fast_p={**want["fast_p"], "0.8": 0.5, "1": 0.3}, geomean_speedup=0.8)
  (run / "metrics.json").write_text(json.dumps({"eager": {"1": got}}))
  assert eval_known.check(str(run), str(tmp_path / "known.expected.json"))
  got["exec_accuracy"] = 10 / 14
  (run / "metrics.json").write_text(json.dumps({"eager": {"1": got}}))
  assert not eval_known.check(str(run), str(tmp_path / "known.expected.json"))
