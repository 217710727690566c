"""Output comparison and memory hygiene for correctness trials (runs inside a worker).

Rules (KernelBench's ``eval_kernel_against_ref`` plus defences against the hacks of the Sakana "AI CUDA
Engineer" incident, KernelBench v0.1 and robust-kbench): shapes and dtypes must match; values within
atol/rtol (``torch.allclose`` semantics); a non-finite candidate value where the reference is finite never
passes, and where the reference itself is non-finite the candidate must match it exactly; the error's L2 norm within
``NORM_RTOL`` of the reference output's norm (``norm_bound``: atol alone passes outputs smaller than it,
whatever their values); outputs must be
plain tensors on the reference's device (no lazy subclasses); inputs are cloned per model and checked for
mutation; freed outputs are poisoned with NaN and the allocator cache emptied, so a no-op kernel cannot
return a stale reference result.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from verifier.api.contract import FailureKind
from verifier.ipc.tensors import flatten


@dataclasses.dataclass
class Comparison:
  kind: FailureKind
  reason: str = ""
  max_abs_diff: float = 0.0
  strict_ok: bool = True


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
  """Bitwise view (NaN-safe equality, no copy) for contiguous floating tensors."""
  if (t.is_floating_point() or t.is_complex()) and t.is_contiguous() and not t.is_complex():
    return t.view(_SAME_SIZE_INT[t.element_size()])
  return t


def mutated(before: list, after: list) -> str:
  """Name of the first input the candidate changed, or ''. Compares bits, so NaN inputs compare equal."""
  for i, (b, a) in enumerate(zip(before, after)):
    if isinstance(b, torch.Tensor):
      if a.shape != b.shape or a.dtype != b.dtype:
        return f"input {i}"
      if a.is_contiguous() and b.is_contiguous():
        same = torch.equal(_bits(a), _bits(b))
      else:
        same = (
          torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
          if a.is_floating_point()
          else torch.equal(a, b)
        )
      if not same:
        return f"input {i}"
  return ""


def _compare_tensor(
  ref: torch.Tensor, out, atol: float, rtol: float, where: str, norm: bool = True
) -> Comparison:
  if not isinstance(out, torch.Tensor):
    return Comparison(
      FailureKind.SHAPE_MISMATCH, f"{where}: expected a tensor, got {type(out).__name__}"
    )
  if type(out) not in (torch.Tensor, torch.nn.Parameter):
    return Comparison(
      FailureKind.LAZY_OUTPUT, f"{where}: output is a {type(out).__name__}, not a plain tensor"
    )
  if out.device != ref.device:
    return Comparison(
      FailureKind.DTYPE_MISMATCH, f"{where}: output on {out.device}, expected {ref.device}"
    )
  if out.shape != ref.shape:
    return Comparison(
      FailureKind.SHAPE_MISMATCH, f"{where}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    )
  if out.dtype != ref.dtype:
    return Comparison(
      FailureKind.DTYPE_MISMATCH, f"{where}: dtype {out.dtype}, expected {ref.dtype}"
    )
  if out.numel() == 0:
    return Comparison(FailureKind.OK)
  if not (ref.is_floating_point() or ref.is_complex()):
    if torch.equal(out, ref):
      return Comparison(FailureKind.OK)
    n = int((out != ref).sum())
    return Comparison(
      FailureKind.WRONG_OUTPUT,
      f"{where}: {n} of {ref.numel()} values differ (exact match required)",
      float("inf"),
      False,
    )
  return _compare_float(ref.detach(), out.detach(), atol, rtol, where, norm)


CHUNK = 1 << 26  # elements per comparison chunk: bounds the temporary memory of a check to ~1 GB
# The aggregate rule beside atol/rtol (docs/verifier-security.md, "Checks"): the error's L2 norm may be
# at most NORM_RTOL (or rtol, if larger) of the reference output's norm, plus NORM_FLOOR * atol per
# element (root mean square) for outputs that are rounding noise themselves (KernelBench L2-23's output
# is ~1e-9: mean ~ 0 after a GroupNorm). A softmax over 16,384 logits returned as the constant 1/16,384
# passes atol = 0.01 everywhere (every true value is under it) but is 27-80 % off in norm.
NORM_RTOL = 0.05
NORM_FLOOR = 1e-6


@dataclasses.dataclass
class _Totals:
  """Running sums of one output's chunked comparison."""

  max_abs: float = 0.0
  n_over: int = 0
  strict_ok: bool = True
  err_sq: float = 0.0
  ref_sq: float = 0.0
  n_finite: int = 0


def _scaled_norm(x: torch.Tensor) -> float:
  """L2 norm without overflow where the plain sum of squares overflows float32 (values past 1e19)."""
  big = float(x.abs().max())
  return float(torch.linalg.vector_norm(x / big)) * big if big > 0 else 0.0


def _chunk_stats(r: torch.Tensor, o: torch.Tensor, atol: float, rtol: float, strict: float):
  """``_chunk_stats_full``'s values with fewer passes over the chunk where every value is finite (the
  per-call compare of the timing's compared calls reads outputs of up to gigabytes): |o - r|, its max
  and the two norms first (one synchronisation); a NaN or Inf in either tensor makes that max NaN or
  Inf, and then the full statistics decide. Otherwise the masks are all true and each count is the
  full one's, taken only where the max can exceed its threshold: a threshold ``t + s * |r|`` is at
  least ``t`` in the working dtype, so no value exceeds it when the max does not (a second
  synchronisation only then). ``||r||`` is ``|| |r| ||`` bit for bit (the norm squares each value)."""
  diff = torch.sub(o, r).abs_()
  head = torch.stack([diff.max(), torch.linalg.vector_norm(diff), torch.linalg.vector_norm(r)])
  max_abs, err, ref_norm = (float(v) for v in head.tolist())
  if not (math.isfinite(max_abs) and math.isfinite(err) and math.isfinite(ref_norm)):
    del diff
    return _chunk_stats_full(r, o, atol, rtol, strict)
  # the thresholds as the chunk's dtype holds them (float32 rounds 0.01 down)
  tol = torch.tensor([atol, strict], dtype=diff.dtype).tolist()
  counts = []
  scale = r.abs() if max_abs > min(tol) else None
  if max_abs > tol[0]:
    counts.append(torch.gt(diff, torch.mul(scale, rtol).add_(atol)).sum().to(diff.dtype))
  if max_abs > tol[1]:
    counts.append(torch.gt(diff, torch.mul(scale, strict).add_(strict)).any().to(diff.dtype))
  got = [float(v) for v in torch.stack(counts).tolist()] if counts else []
  n_over = got.pop(0) if max_abs > tol[0] else 0.0
  strict_bad = got.pop(0) if max_abs > tol[1] else 0.0
  return [0.0, 0.0, max_abs, n_over, strict_bad, err, ref_norm]


def _chunk_stats_full(r: torch.Tensor, o: torch.Tensor, atol: float, rtol: float, strict: float):
  """One chunk's statistics, read back with one synchronisation: NaN/Inf where the reference is
  finite, non-finite reference values, max |diff|, values outside atol/rtol, values outside the strict
  tolerance, and the norms of the error and of the reference (non-finite reference values left out:
  they are judged apart)."""
  r_fin = torch.isfinite(r)
  bad = (r_fin & ~torch.isfinite(o)).sum()
  diff = torch.where(r_fin, (o - r).abs(), 0.0)
  scale = torch.where(r_fin, r.abs(), 0.0)
  stats = torch.stack(
    [
      bad.to(diff.dtype),
      (~r_fin).sum().to(diff.dtype),
      diff.max(),
      (diff > atol + rtol * scale).sum().to(diff.dtype),
      (diff > strict + strict * scale).any().to(diff.dtype),
      torch.linalg.vector_norm(diff),
      torch.linalg.vector_norm(scale),
    ]
  )
  out = [float(v) for v in stats.tolist()]
  if not (math.isfinite(out[5]) and math.isfinite(out[6])) and not out[0]:  # overflow: rare
    out[5], out[6] = _scaled_norm(diff), _scaled_norm(scale)
  return out


def _compare_float(
  ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float, where: str, norm: bool = True
) -> Comparison:
  """Chunked comparison in float32 (float64 stays float64): level-1 outputs reach billions of elements,
  and upcasting them whole to float64 ran the GPU out of memory (H200 bench, 2026-11-29). Each value
  within atol/rtol (``torch.allclose``), and the error's norm within ``NORM_RTOL`` of the reference's
  (``norm_bound``; not for an output the reference does not determine, ``determined``); one
  synchronisation per chunk."""
  from verifier.api.contract import STRICT_TOLERANCE

  work = torch.float64 if ref.dtype == torch.float64 else torch.float32
  r_all, o_all = ref.reshape(-1), out.reshape(-1)
  if ref.is_complex():
    r_all, o_all = torch.view_as_real(r_all).reshape(-1), torch.view_as_real(o_all).reshape(-1)
  n = r_all.numel()
  t = _Totals()
  nonfinite_mismatch = 0
  for lo in range(0, n, CHUNK):
    r = r_all[lo : lo + CHUNK].to(work)
    o = o_all[lo : lo + CHUNK].to(work)
    bad, ref_nonfinite, max_abs, n_over, strict_bad, err, ref_norm = _chunk_stats(
      r, o, atol, rtol, STRICT_TOLERANCE
    )
    if bad:
      return Comparison(
        FailureKind.NONFINITE_OUTPUT,
        f"{where}: {int(bad)} NaN/Inf values where the reference is finite",
        float("inf"),
        False,
      )
    if ref_nonfinite:
      nf = ~torch.isfinite(r)
      same_nan = torch.equal(torch.isnan(r[nf]), torch.isnan(o[nf]))
      same_inf = torch.equal(r[nf & torch.isinf(r)], o[nf & torch.isinf(r)])
      nonfinite_mismatch += not (same_nan and same_inf)
    t.max_abs = max(t.max_abs, max_abs)
    t.n_over += int(n_over)
    t.strict_ok = t.strict_ok and not strict_bad
    t.err_sq += err * err
    t.ref_sq += ref_norm * ref_norm
    t.n_finite += r.numel() - int(ref_nonfinite)
    del r, o
  if nonfinite_mismatch:
    return Comparison(
      FailureKind.NONFINITE_OUTPUT,
      f"{where}: non-finite values do not match the reference's",
      float("inf"),
      False,
    )
  if t.n_over:
    return Comparison(
      FailureKind.WRONG_OUTPUT,
      f"{where}: {t.n_over} of {n} values outside atol={atol} rtol={rtol} "
      f"(max abs diff {t.max_abs:.3g})",
      t.max_abs,
      t.strict_ok,
    )
  err, ref_norm = math.sqrt(t.err_sq), math.sqrt(t.ref_sq)
  bound = norm_bound(ref_norm, t.n_finite, atol, rtol)
  if norm and err > bound:
    return Comparison(
      FailureKind.WRONG_OUTPUT,
      f"{where}: every value within atol={atol} rtol={rtol}, but the error's norm {err:.3g} is "
      f"{err / max(ref_norm, 1e-300):.3g} of the reference's ({ref_norm:.3g}); at most "
      f"{bound:.3g} passes (max abs diff {t.max_abs:.3g})",
      t.max_abs,
      False,
    )
  return Comparison(FailureKind.OK, "", t.max_abs, t.strict_ok)


def norm_bound(ref_norm: float, n: int, atol: float, rtol: float) -> float:
  """The largest error norm that passes: ``max(NORM_RTOL, rtol) * ||ref|| + NORM_FLOOR * atol *
  sqrt(n)`` for ``n`` finite reference values."""
  return max(NORM_RTOL, rtol) * ref_norm + NORM_FLOOR * atol * math.sqrt(n)


# The norm rule judges an output the reference determines: one that inputs perturbed by PERTURBATION
# (relative, normal) move by less than NOISE_SHARE of its norm. An output that is rounding noise (a sum
# over a GroupNorm's output, KernelBench L2-23/37/62/88/94: mathematically ~0) moves by ~100 % under any
# perturbation; there atol/rtol alone judge, as before, and zeros stay as right as the reference.
PERTURBATION = 1e-3
NOISE_SHARE = 0.1


def perturbed(values, seed: int):
  """``values`` with every floating tensor scaled element-wise by ``1 - PERTURBATION * |N(0, 1)|``: each
  value moves toward zero, never past it nor away from it, so it stays in any range its draw was in that
  holds zero or is bounded by it (``torch.rand(n) * 1000`` floored into embedding indices: scaled by
  ``1 + ...``, a value near 1,000 became index 1,000, out of range; on a GPU that device-side assert killed
  the checker, and which tasks it hit depended on the trials' seeds, DICE's 7798 among them)."""
  gens: dict = {}

  def one(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
      if v.device not in gens:  # drawn where the tensor lives: level-1 inputs reach gigabytes
        gens[v.device] = torch.Generator(device=v.device).manual_seed(seed)
      gen = gens[v.device]
      noise = torch.randn(v.shape, generator=gen, device=v.device, dtype=torch.float32)
      return v * (1 - PERTURBATION * noise.abs()).to(v.dtype)
    if isinstance(v, (list, tuple)):
      return type(v)(one(x) for x in v)
    return v

  return [one(v) for v in values]


def determined(ref_out, moved_out) -> tuple[bool, ...]:
  """Per output leaf (``flatten`` order): whether the norm rule applies to it: a floating tensor the
  perturbed inputs moved by less than ``NOISE_SHARE`` of its norm (finite values only)."""
  flags = []
  for r, m in zip(flatten(ref_out), flatten(moved_out)):
    if not (isinstance(r, torch.Tensor) and isinstance(m, torch.Tensor) and r.is_floating_point()):
      flags.append(True)
      continue
    ref_sq = moved_sq = 0.0
    r_all, m_all = r.detach().reshape(-1), m.detach().reshape(-1)
    for lo in range(0, r_all.numel(), CHUNK):  # in chunks: level-1 outputs reach gigabytes
      rc, mc = r_all[lo : lo + CHUNK].float(), m_all[lo : lo + CHUNK].float()
      fin = torch.isfinite(rc) & torch.isfinite(mc)
      ref_sq += float(torch.linalg.vector_norm(torch.where(fin, rc, 0.0))) ** 2
      moved_sq += float(torch.linalg.vector_norm(torch.where(fin, mc - rc, 0.0))) ** 2
    flags.append(ref_sq > 0 and math.sqrt(moved_sq) < NOISE_SHARE * math.sqrt(ref_sq))
  return tuple(flags)


def compare_outputs(
  ref_out, out, atol: float, rtol: float, where: str, norm_rule: tuple[bool, ...] | None = None
) -> Comparison:
  """Every output leaf of ``out`` against ``ref_out``'s; ``norm_rule[i]``: whether leaf ``i`` is judged
  by the norm rule too (``determined``; all of them when None)."""
  refs, outs = flatten(ref_out), flatten(out)
  if len(refs) != len(outs):
    return Comparison(
      FailureKind.SHAPE_MISMATCH, f"{where}: {len(outs)} outputs, expected {len(refs)}"
    )
  worst = Comparison(FailureKind.OK)
  for i, (r, o) in enumerate(zip(refs, outs)):
    label = where if len(refs) == 1 else f"{where}, output {i}"
    if isinstance(r, torch.Tensor):
      norm = norm_rule is None or i >= len(norm_rule) or norm_rule[i]
      c = _compare_tensor(r, o, atol, rtol, label, norm)
    elif isinstance(o, torch.Tensor):
      c = Comparison(
        FailureKind.SHAPE_MISMATCH, f"{label}: expected {type(r).__name__}, got a tensor"
      )
    else:
      ok = (r == o) or (
        isinstance(r, float)
        and isinstance(o, (int, float))
        and math.isclose(r, o, rel_tol=rtol, abs_tol=atol)
      )
      c = Comparison(
        FailureKind.OK if ok else FailureKind.WRONG_OUTPUT, "" if ok else f"{label}: {o!r} != {r!r}"
      )
    if c.kind is not FailureKind.OK:
      return c
    worst = Comparison(
      FailureKind.OK, "", max(worst.max_abs_diff, c.max_abs_diff), worst.strict_ok and c.strict_ok
    )
  return worst
