r"""Generate with the KV-cached block-diffusion sampler from an HF checkpoint directory.

  python -m experiments.generate --hf_dir=DIR --prompt="Write a CUDA add kernel." \
      --strategy=low_confidence_dynamic --threshold=0.9 --steps=4 --max_new_tokens=512

The prompt is wrapped in the tokenizer's chat template (`--nochat` to send it raw); the tokenizer is
read from `--tokenizer_dir` (default: the checkpoint directory) and checked against the model
(vocabulary size, mask and eos ids). Without a tokenizer, pass `--prompt_ids=1,2,3` and the
output is printed as ids. Prints the text and the decoding stats:
generated tokens, decode forwards, tokens per forward, denoising steps used, wall time.
"""

import os
import time

import jax
import numpy as np
from absl import app, flags, logging

from dice_jax.diffusion import remasking, sampler
from dice_jax.errors import UserError
from dice_jax.hf import checkpoint
from experiments import _cli

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("prompt", None, "Prompt text (user message unless --nochat).")
flags.DEFINE_list("prompt_ids", None, "Prompt as token ids (when no tokenizer is available).")
flags.DEFINE_string("tokenizer_dir", None, "Tokenizer directory (default: --hf_dir).")
flags.DEFINE_bool("chat", True, "Wrap --prompt in the chat template as a user turn.")
flags.DEFINE_enum(
  "strategy", "low_confidence_static", list(remasking.STRATEGIES), "Remasking strategy."
)
flags.DEFINE_float("threshold", 0.9, "Confidence threshold (low_confidence_dynamic).")
flags.DEFINE_float("eb_threshold", 0.35, "Entropy bound (entropy_bounded).")
flags.DEFINE_integer("block_size", 0, "Block size (0: the checkpoint's; another is refused).")
flags.DEFINE_integer("steps", 4, "Max denoising steps per block.")
flags.DEFINE_integer("max_new_tokens", 512, "Max generated tokens.")
flags.DEFINE_float("temperature", 0.0, "Temperature (0 = greedy).")
flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
flags.DEFINE_enum(
  "confidence",
  "filtered",
  list(remasking.CONFIDENCES),
  "Confidence of a candidate: 'filtered' (its probability after top-k/top-p/temperature, "
  "JetEngine) or 'unfiltered' (softmax(logits / T), SDAR's evaluation decoder; with --top_k=1 "
  "--temperature=1 --strategy=low_confidence_static --block_alignment=absolute it is DICE's eval).",
)
flags.DEFINE_integer("num_samples", 1, "Samples of the prompt, decoded as one batch.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_enum(
  "block_alignment",
  "response",
  ["response", "absolute"],
  "Block grid: 'response' (blocks start at the response, the training convention) or "
  "'absolute' (block = position // b: SDAR's and DICE's published decoding).",
)
flags.DEFINE_string("attention_impl", "dense", "Model attention: dense | flash (GPU) | ...")
flags.DEFINE_string("param_dtype", "bfloat16", "Parameter dtype.")
flags.DEFINE_bool("warm_timing", False, "Generate twice and time the second (compiled) call.")
flags.mark_flag_as_required("hf_dir")


def _load_tokenizer(cfg):
  """--tokenizer_dir's tokenizer, else --hf_dir's, else None; checked against the model."""
  if FLAGS.tokenizer_dir is not None:
    return checkpoint.load_tokenizer(
      FLAGS.tokenizer_dir, cfg, where=f"generate --tokenizer_dir={FLAGS.tokenizer_dir}"
    )
  if checkpoint.has_tokenizer(FLAGS.hf_dir):
    return checkpoint.load_tokenizer(FLAGS.hf_dir, cfg, where=f"generate --hf_dir={FLAGS.hf_dir}")
  logging.warning("%s has no tokenizer: token ids only", FLAGS.hf_dir)
  return None


def main(argv):
  del argv
  if (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
    raise app.UsageError("pass exactly one of --prompt and --prompt_ids")
  if FLAGS.num_samples < 1:
    raise UserError(f"--num_samples must be >= 1, got {FLAGS.num_samples}")
  if not os.path.isdir(FLAGS.hf_dir):
    raise UserError(f"--hf_dir {FLAGS.hf_dir}: no such directory")
  if FLAGS.tokenizer_dir is not None and not os.path.isdir(FLAGS.tokenizer_dir):
    raise UserError(f"--tokenizer_dir {FLAGS.tokenizer_dir}: no such directory")
  mcfg = checkpoint.read_config(FLAGS.hf_dir)
  tok = _load_tokenizer(mcfg)
  if FLAGS.prompt is not None:
    if tok is None:
      raise UserError(
        f"--prompt needs a tokenizer and {FLAGS.hf_dir} has none: pass --tokenizer_dir=DIR, "
        "or the prompt as --prompt_ids=1,2,3"
      )
    text = (
      tok.apply_chat_template([{"role": "user", "content": FLAGS.prompt}])
      if FLAGS.chat
      else FLAGS.prompt
    )
    prompt = tok.encode(text)
  else:
    not_ids = [i for i in FLAGS.prompt_ids if not i.strip().isdigit()]
    if not_ids:
      raise UserError(f"--prompt_ids: {not_ids[0]!r} is not a token id (a number >= 0)")
    prompt = [int(i) for i in FLAGS.prompt_ids]
    bad = [i for i in prompt if not 0 <= i < mcfg.vocab_size]
    if bad:
      raise UserError(f"--prompt_ids {bad} outside the model's vocabulary [0, {mcfg.vocab_size})")
  if tok is not None:
    stop = tok.stop_token_ids
  else:
    eos = mcfg.eos_token_id
    stop = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))
  with _cli.user_errors_from(ValueError):  # a setting the sampler or this model cannot use
    scfg = sampler.SamplerConfig(
      block_size=FLAGS.block_size,  # 0: the model's (the sampler resolves and checks it)
      steps=FLAGS.steps,
      strategy=FLAGS.strategy,
      threshold=FLAGS.threshold,
      eb_threshold=FLAGS.eb_threshold,
      temperature=FLAGS.temperature,
      top_k=FLAGS.top_k,
      top_p=FLAGS.top_p,
      confidence=FLAGS.confidence,
      max_new_tokens=FLAGS.max_new_tokens,
      stop_ids=tuple(stop),
      block_alignment=FLAGS.block_alignment,
      pad_id=mcfg.pad_token_id if mcfg.pad_token_id is not None else 0,
    ).for_model(mcfg)  # the model's block size, or the one check of --block_size

  t0 = time.perf_counter()
  model, cfg = checkpoint.import_hf(
    FLAGS.hf_dir,
    check_tokenizer=False,  # checked above, against --tokenizer_dir when given
    param_dtype=FLAGS.param_dtype,
    attention_impl=FLAGS.attention_impl,
  )
  logging.info("loaded %s in %.1f s", FLAGS.hf_dir, time.perf_counter() - t0)
  prompts = [prompt] * FLAGS.num_samples
  rng = jax.random.key(FLAGS.seed)
  t0 = time.perf_counter()
  out = sampler.generate(model, prompts, scfg, rng)
  jax.block_until_ready(out.tokens)
  run_s = first_s = time.perf_counter() - t0  # includes compilation
  if FLAGS.warm_timing:
    t0 = time.perf_counter()
    out = sampler.generate(model, prompts, scfg, rng)
    jax.block_until_ready(out.tokens)
    run_s = time.perf_counter() - t0

  responses = out.responses()
  for i, resp in enumerate(responses):
    print(f"=== sample {i} ({len(resp)} tokens) ===")
    print(tok.decode(resp) if tok is not None else resp)
  n_tok = int(np.asarray(out.response_lengths).sum())
  forwards = int(out.forwards)
  steps = np.asarray(out.steps_used)
  print(
    f"--- prompt {len(prompt)} tokens; generated {n_tok} tokens in {forwards} decode forwards "
    f"({n_tok / max(forwards, 1):.2f} tokens/forward over the batch of {len(prompts)}); "
    f"denoising steps used per sample {steps.tolist()} "
    f"({n_tok / max(int(steps.sum()), 1):.2f} tokens/step); strategy {scfg.strategy}, "
    f"block {scfg.block_size}, steps {scfg.steps}; {run_s:.2f} s "
    f"({n_tok / run_s:,.0f} tok/s{'' if FLAGS.warm_timing else ', incl. compilation'}; "
    f"first call {first_s:.1f} s)"
  )


if __name__ == "__main__":
  _cli.run(main)
