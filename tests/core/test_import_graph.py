"""The import graph (parsed with ast, lazy imports inside functions included) has no upward arrow.

Floors of the learner, lowest first; a module may import its own floor and the floors below:
  0  dice_jax.sharding, dice_jax.distributed, dice_jax.atomic, dice_jax.errors, dice_jax.recipe
     (helpers every floor uses; recipe: DICE's and our field defaults), and dice_jax.verifier_client (the learner's one gRPC client: the CuKe builder,
     RL and eval use it)
  1  dice_jax.model
  2  dice_jax.hf, dice_jax.diffusion, dice_jax.data
  3  dice_jax.train
  4  dice_jax.rl, dice_jax.eval
  5  dice_jax.tpu_lowering (whole programs of every floor exported for TPU)
The verifier (a separate deployable service) never imports the learner or JAX.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
FLOORS = {
  "sharding": 0,
  "distributed": 0,
  "atomic": 0,
  "errors": 0,
  "recipe": 0,
  "verifier_client": 0,
  "model": 1,
  "hf": 2,
  "diffusion": 2,
  "data": 2,
  "train": 3,
  "rl": 4,
  "eval": 4,
  "tpu_lowering": 5,
}
LEARNER_ONLY = ("dice_jax", "jax", "jaxlib", "flax", "optax", "orbax", "grain")


def imports(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
  """(line, absolute module name) of every import in the file (relative ones resolved)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      out.append((node.lineno, base))
      out += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # `from pkg import mod`
  return out


def floor_of(module: str):
  parts = module.split(".")
  if parts[0] != "dice_jax" or len(parts) < 2:
    return None
  return FLOORS.get(parts[1])


def test_every_learner_package_has_a_floor():
  pkgs = {p.stem if p.is_file() else p.name for p in (REPO / "dice_jax").iterdir()}
  pkgs -= {"__init__", "__pycache__"}
  assert pkgs <= set(FLOORS), f"give these a floor in this test: {sorted(pkgs - set(FLOORS))}"


def test_no_learner_module_imports_a_higher_floor():
  arrows = []
  for path in sorted((REPO / "dice_jax").rglob("*.py")):
    rel = path.relative_to(REPO)
    module = ".".join(rel.with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    own = floor_of(module)
    if own is None:
      continue
    for line, target in imports(path, package):
      floor = floor_of(target)
      if floor is not None and floor > own:
        arrows.append(f"{rel}:{line} ({module}, floor {own}) imports {target} (floor {floor})")
  assert not arrows, "upward imports:\n" + "\n".join(sorted(set(arrows)))


def test_verifier_never_imports_the_learner_or_jax():
  found = []
  for path in sorted((REPO / "verifier").rglob("*.py")):
    rel = path.relative_to(REPO)
    package = ".".join(rel.with_suffix("").parts[:-1])
    for line, target in imports(path, package):
      if target.split(".")[0] in LEARNER_ONLY:
        found.append(f"{rel}:{line} imports {target}")
  assert not found, "\n".join(sorted(set(found)))


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
  f = tmp_path / "m.py"
  f.write_text("def f():\n  from dice_jax.train import loop\n\nfrom ..rl import x\n")
  got = imports(f, "dice_jax.model")
  assert (2, "dice_jax.train.loop") in got and (4, "dice_jax.rl.x") in got
  assert floor_of("dice_jax.train.loop") == 3 and floor_of("dice_jax.rl.x") == 4
