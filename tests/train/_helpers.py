"""Helpers for the training tests: packed SFT batches, a tiny CuKe-format data file."""

import numpy as np


def packed_batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
  """Rows holding 1-3 packed samples (prompt then response) and trailing padding."""
  rng = np.random.default_rng(seed)
  out = {k: np.zeros((rows, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids")}
  out["loss_mask"] = np.zeros((rows, seq_len), bool)
  for r in range(rows):
    t, seg = 0, 1
    while t < seq_len - 8 and seg <= 3:
      n = int(rng.integers(8, max(9, (seq_len - t) // 2 + 1))) // 4 * 4
      n = min(n, seq_len - t)
      prompt = int(rng.integers(1, n // 2 + 1))
      out["tokens"][r, t : t + n] = rng.integers(2, vocab - 1, n)
      out["positions"][r, t : t + n] = np.arange(n)
      out["segment_ids"][r, t : t + n] = seg
      out["loss_mask"][r, t + prompt : t + n] = True
      t, seg = t + n, seg + 1
  return out


def write_cuke_file(path, n: int = 24) -> str:
  """A small CuKe-format jsonl ({prompt, response, id}) of kernel-ish texts."""
  import json

  ops = ["relu", "gelu", "add", "mul", "softmax", "matmul"]
  with open(path, "w") as f:
    for i in range(n):
      op = ops[i % len(ops)]
      prompt = f"Write a CUDA kernel for {op} #{i}."
      response = (
        f"__global__ void {op}_{i}(const float* x, float* y, int n) {{\n"
        f"  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
        f"  if (i < n) y[i] = {op}(x[i]);\n}}\n"
      )
      f.write(json.dumps({"prompt": prompt, "response": response, "id": f"s{i}"}) + "\n")
  return str(path)
