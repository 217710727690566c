"""The static check is a registry of named rules, each with its rationale; strictness selects them."""

from verifier.api.contract import FailureKind, Strictness
from verifier.static.static_check import RULES, check_candidate, rules_for


def test_every_rule_has_a_unique_name_and_a_rationale():
  names = [r.name for r in RULES]
  assert len(names) == len(set(names)) == 16
  assert all(len(r.rationale) > 30 for r in RULES), [
    r.name for r in RULES if len(r.rationale) <= 30
  ]


def test_strictness_selects_the_rules_that_reject():
  assert rules_for(Strictness.preset("strict")) == names_all()
  assert rules_for(Strictness.preset("kernelbench")) == [
    "imports",
    "openmp",
    "alias_budget",
    "fallback",
    "monkey_patch",
    "lazy_output",
    "streams",
    "own_kernel",
  ]
  assert rules_for(Strictness.preset("off")) == ["imports", "alias_budget"]


def names_all():
  return [r.name for r in RULES]


SOURCE = """import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(name="e", cpp_sources="torch::Tensor f(torch::Tensor x) { return x; }", functions=["f"])


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(ext.f(x))
"""


def test_a_rule_that_only_warns_under_a_strictness_still_reports():
  strict = check_candidate(SOURCE, Strictness.preset("strict"), "cpu")
  assert strict.kind is FailureKind.TORCH_COMPUTE and "torch.relu" in strict.reason
  lenient = check_candidate(SOURCE, Strictness.preset("kernelbench"), "cpu")
  assert lenient.kind is FailureKind.OK and lenient.warnings == ("forward path calls torch.relu",)
  assert lenient.functions == ("f",)
