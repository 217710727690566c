"""experiments.hlo_costs.describe: what a profiler kernel name computes, read off the HLO text."""

import gzip

import jax
import jax.numpy as jnp
import pytest

from experiments import hlo_costs


def _module() -> str:
  f = jax.jit(lambda a, b: (jnp.tanh(a @ b) * 2.0).sum(1))
  return f.lower(jnp.ones((64, 32)), jnp.ones((32, 16))).compile().as_text()


def test_a_fusion_kernel_is_its_instruction_operands_and_body():
  text = _module()
  instrs, comps = hlo_costs._lines(text)
  fusion = next(n for n, line in instrs.items() if " fusion(" in line and "reduce" in n)
  kernel = fusion.replace(".", "_")  # a trace names `x.3` as `x_3`
  got = hlo_costs.describe(text, kernel)
  lines = got.splitlines()
  assert lines[0] == instrs[fusion] and lines[1] == "operands:"
  assert "tanh(" in got and "reduce(" in got  # the called computation's body
  assert any(line.startswith("  %") and "fusion(" in line for line in lines[2:4])  # its operand


def test_an_unknown_kernel_is_named(tmp_path, capsys):
  with pytest.raises(KeyError, match="no instruction 'nvjet_x' in this HLO module"):
    hlo_costs.describe(_module(), "nvjet_x")
  path = tmp_path / "m.txt.gz"
  with gzip.open(path, "wt") as f:
    f.write(_module())
  with pytest.raises(SystemExit) as e:
    hlo_costs.main([str(path), "nvjet_x"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.endswith("error: no instruction 'nvjet_x' in this HLO module\n")
