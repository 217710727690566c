"""Output comparison and memory hygiene for correctness trials (runs inside a worker).

Rules (reference doc sections 1.5, 2.1, 2.6, 2.8): shapes and dtypes must match; values within
atol/rtol (``torch.allclose`` semantics); a non-finite candidate value where the reference is finite never
passes, and where the reference itself is non-finite the candidate must match it exactly; outputs must be
plain tensors on the reference's device (no lazy subclasses); inputs are cloned per model and checked for
mutation; freed outputs are poisoned with NaN and the allocator cache emptied, so a no-op kernel cannot
return a stale reference result.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from verifier.contract import FailureKind


@dataclasses.dataclass
class Comparison:
    kind: FailureKind
    reason: str = ""
    max_abs_diff: float = 0.0
    strict_ok: bool = True


def flatten(out) -> list:
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in flatten(item)]
    if isinstance(out, dict):
        return [leaf for k in sorted(out) for leaf in flatten(out[k])]
    return [out]


def clone_args(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def to_device(args: list, device: torch.device) -> list:
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def mutated(before: list, after: list) -> str:
    """Name of the first input the candidate changed, or ''."""
    for i, (b, a) in enumerate(zip(before, after)):
        if isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                    torch.nan_to_num(a, nan=0.0) if a.is_floating_point() else a,
                    torch.nan_to_num(b, nan=0.0) if b.is_floating_point() else b):
                return f"input {i}"
    return ""


def poison(values) -> None:
    """Overwrite tensors we are about to free so reused memory holds NaN, not a valid result."""
    for t in flatten(values):
        if isinstance(t, torch.Tensor) and t.numel() and not t.requires_grad:
            try:
                if t.is_floating_point() or t.is_complex():
                    t.fill_(float("nan"))
                elif t.dtype != torch.bool:
                    t.fill_(-1)
            except RuntimeError:
                pass  # non-writable views (expanded) are left alone


def empty_caches(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _compare_tensor(ref: torch.Tensor, out, atol: float, rtol: float, where: str) -> Comparison:
    if not isinstance(out, torch.Tensor):
        return Comparison(FailureKind.SHAPE_MISMATCH, f"{where}: expected a tensor, got {type(out).__name__}")
    if type(out) not in (torch.Tensor, torch.nn.Parameter):
        return Comparison(FailureKind.LAZY_OUTPUT, f"{where}: output is a {type(out).__name__}, not a plain tensor")
    if out.device != ref.device:
        return Comparison(FailureKind.DTYPE_MISMATCH, f"{where}: output on {out.device}, expected {ref.device}")
    if out.shape != ref.shape:
        return Comparison(FailureKind.SHAPE_MISMATCH, f"{where}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        return Comparison(FailureKind.DTYPE_MISMATCH, f"{where}: dtype {out.dtype}, expected {ref.dtype}")
    if out.numel() == 0:
        return Comparison(FailureKind.OK)
    if not (ref.is_floating_point() or ref.is_complex()):
        if torch.equal(out, ref):
            return Comparison(FailureKind.OK)
        n = int((out != ref).sum())
        return Comparison(FailureKind.WRONG_OUTPUT, f"{where}: {n} of {ref.numel()} values differ (exact match required)",
                          float("inf"), False)
    r, o = ref.detach().double(), out.detach().double()
    ref_finite, out_finite = torch.isfinite(r), torch.isfinite(o)
    bad = ref_finite & ~out_finite
    if bool(bad.any()):
        return Comparison(FailureKind.NONFINITE_OUTPUT,
                          f"{where}: {int(bad.sum())} NaN/Inf values where the reference is finite", float("inf"), False)
    nonfinite_ref = ~ref_finite
    if bool(nonfinite_ref.any()):
        same = torch.equal(torch.isnan(r), torch.isnan(o)) and torch.equal(r[torch.isinf(r)], o[torch.isinf(r)])
        if not same:
            return Comparison(FailureKind.NONFINITE_OUTPUT,
                              f"{where}: non-finite values do not match the reference's", float("inf"), False)
    diff = (o - r).abs()
    diff[nonfinite_ref] = 0
    max_abs = float(diff.max())
    limit = atol + rtol * r.abs()
    limit[nonfinite_ref] = math.inf
    over = diff > limit
    from verifier.contract import STRICT_TOLERANCE
    strict_ok = not bool((diff > STRICT_TOLERANCE + STRICT_TOLERANCE * r.abs()).any())
    if bool(over.any()):
        return Comparison(FailureKind.WRONG_OUTPUT,
                          f"{where}: {int(over.sum())} of {ref.numel()} values outside atol={atol} rtol={rtol} "
                          f"(max abs diff {max_abs:.3g})", max_abs, strict_ok)
    return Comparison(FailureKind.OK, "", max_abs, strict_ok)


def compare_outputs(ref_out, out, atol: float, rtol: float, where: str) -> Comparison:
    refs, outs = flatten(ref_out), flatten(out)
    if len(refs) != len(outs):
        return Comparison(FailureKind.SHAPE_MISMATCH, f"{where}: {len(outs)} outputs, expected {len(refs)}")
    worst = Comparison(FailureKind.OK)
    for i, (r, o) in enumerate(zip(refs, outs)):
        label = where if len(refs) == 1 else f"{where}, output {i}"
        if isinstance(r, torch.Tensor):
            c = _compare_tensor(r, o, atol, rtol, label)
        elif isinstance(o, torch.Tensor):
            c = Comparison(FailureKind.SHAPE_MISMATCH, f"{label}: expected {type(r).__name__}, got a tensor")
        else:
            ok = (r == o) or (isinstance(r, float) and isinstance(o, (int, float))
                              and math.isclose(r, o, rel_tol=rtol, abs_tol=atol))
            c = Comparison(FailureKind.OK if ok else FailureKind.WRONG_OUTPUT, "" if ok else f"{label}: {o!r} != {r!r}")
        if c.kind is not FailureKind.OK:
            return c
        worst = Comparison(FailureKind.OK, "", max(worst.max_abs_diff, c.max_abs_diff), worst.strict_ok and c.strict_ok)
    return worst
