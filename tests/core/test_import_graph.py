"""The import graph (parsed with ast, lazy imports inside functions included) has no upward arrow.

Floors of the learner, lowest first; a module may import its own floor and the floors below:
  0  dice_jax.sharding, dice_jax.distributed, dice_jax.atomic, dice_jax.errors, dice_jax.recipe
     (helpers every floor uses; recipe: DICE's and our field defaults), dice_jax.compile_cache
     (JAX's persistent compilation cache for the launchers), dice_jax.compile_clock (compile seconds),
     dice_jax.trace_context (JAX's trace context settled before the first trace),
     and dice_jax.verifier_client (the learner's thread face of verifier.api's one client: the CuKe builder,
     RL and eval use it)
  1  dice_jax.model
  2  dice_jax.hf, dice_jax.diffusion, dice_jax.data
  3  dice_jax.train
  4  dice_jax.rl, dice_jax.eval
  5  dice_jax.tpu_lowering (whole programs of every floor exported for TPU), dice_jax.tpu_topology
     and dice_jax.tpu_memory (those programs compiled for named TPU slices)
The verifier (a separate deployable service) never imports the learner or JAX, and the learner imports
only ``verifier.api`` (no torch there). The verifier's packages, lowest first (``LAYERS``); a package imports
only lower layers (never its own layer's neighbours), so packages form no cycle:
  0  api        contract, wire, proto stubs, the one client
  1  ipc        what the two processes of a check share: channel, records, tensor exchange
  2  sandbox    confinement and worker pools
  3  static     the static check and its bounded workers
  4  build      build stage, compile worker, caches, artefact check
  5  candidate  the untrusted processes (fork server, worker, candidate runner)
  5  check      the trusted checker: references, comparison, timing, runtime verdict
  6  serve      service, server, admission, request table, local launcher
  7  top        cli, batch, verdict_file, bench, __main__
``python -m tests.core.test_import_graph [VERIFIER_DIR]`` prints the verifier's module layers and arrows.
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
  "compile_cache": 0,
  "compile_clock": 0,
  "trace_context": 0,
  "model": 1,
  "hf": 2,
  "diffusion": 2,
  "data": 2,
  "train": 3,
  "rl": 4,
  "eval": 4,
  "tpu_lowering": 5,
  "tpu_topology": 5,
  "tpu_memory": 5,
}
LEARNER_ONLY = ("dice_jax", "jax", "jaxlib", "flax", "optax", "orbax", "grain")
LAYERS = {
  "api": 0,
  "ipc": 1,
  "sandbox": 2,
  "static": 3,
  "build": 4,
  "candidate": 5,
  "check": 5,
  "serve": 6,
  "top": 7,
}
TOP = ("cli", "batch", "verdict_file", "bench", "__main__", "__init__")


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


def verifier_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Module name -> file for every module under ``root`` (a ``verifier`` directory)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = ("verifier",) + path.relative_to(root).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def verifier_edges(root: pathlib.Path) -> dict[str, set[str]]:
  """module -> the verifier modules it imports (lazy imports included; ``from pkg import mod`` points at
  mod, ``from mod import name`` at mod)."""
  modules = verifier_modules(root)
  edges = {}
  for module, path in modules.items():
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    got = {t for _, t in imports(path, package) if t in modules}
    # `from verifier.x import mod` also yields `verifier.x`; keep the package only when nothing below it is named
    edges[module] = {t for t in got if t != module and not any(o.startswith(t + ".") for o in got)}
  return edges


def layers_and_arrows(root: pathlib.Path) -> tuple[int, int]:
  """(import floors, arrows) of the verifier's module graph: a module's floor is one above the highest
  floor it imports (0 for none); raises on a cycle."""
  edges = verifier_edges(root)
  floor: dict[str, int] = {}

  def visit(m, path=()):
    if m in path:
      raise ValueError("import cycle: " + " -> ".join(path + (m,)))
    if m not in floor:
      floor[m] = 1 + max((visit(t, path + (m,)) for t in edges[m]), default=-1)
    return floor[m]

  for m in edges:
    visit(m)
  return len(set(floor.values())), sum(len(v) for v in edges.values())


def layer_of(module: str) -> str:
  parts = module.split(".")
  if len(parts) == 1 or (len(parts) == 2 and parts[1] in TOP):
    return "top"
  return parts[1]


def test_every_verifier_package_has_a_layer():
  pkgs = {layer_of(m) for m in verifier_modules(REPO / "verifier")}
  assert pkgs <= set(LAYERS), (
    f"give these a layer in this test (or TOP): {sorted(pkgs - set(LAYERS))}"
  )


def test_verifier_packages_import_only_lower_layers():
  bad = []
  for module, targets in verifier_edges(REPO / "verifier").items():
    own = layer_of(module)
    for t in targets:
      other = layer_of(t)
      if other != own and LAYERS[other] >= LAYERS[own]:
        bad.append(
          f"{module} ({own}, layer {LAYERS[own]}) imports {t} ({other}, layer {LAYERS[other]})"
        )
  assert not bad, "upward or sideways imports between verifier packages:\n" + "\n".join(sorted(bad))


def test_verifier_modules_form_no_cycle():
  layers_and_arrows(REPO / "verifier")  # raises naming the cycle


def test_checker_and_candidate_never_import_each_other():
  """Trust rule: the trusted checker never loads candidate-side code; the candidate side never loads
  the checker's or the service's code."""
  forbidden = {"check": ("candidate",), "candidate": ("check", "serve")}
  bad = [
    f"{m} imports {t}"
    for m, targets in verifier_edges(REPO / "verifier").items()
    for t in targets
    if layer_of(t) in forbidden.get(layer_of(m), ())
  ]
  assert not bad, "\n".join(sorted(bad))


def test_the_learner_imports_only_verifier_api():
  bad = []
  for path in sorted((REPO / "dice_jax").rglob("*.py")):
    rel = path.relative_to(REPO)
    package = ".".join(rel.with_suffix("").parts[:-1])
    for line, target in imports(path, package):
      if target.split(".")[0] == "verifier" and target.split(".")[:2] != ["verifier", "api"]:
        if target != "verifier":  # `from verifier.api import x` also names `verifier.api.x`
          bad.append(f"{rel}:{line} imports {target}")
  assert not bad, "the learner may import only verifier.api:\n" + "\n".join(sorted(set(bad)))


def test_verifier_api_imports_no_torch():
  bad = []
  for path in sorted((REPO / "verifier" / "api").rglob("*.py")):
    rel = path.relative_to(REPO)
    package = ".".join(rel.with_suffix("").parts[:-1])
    bad += [f"{rel}:{line}" for line, t in imports(path, package) if t.split(".")[0] == "torch"]
  assert not bad, "verifier.api must not import torch: " + ", ".join(bad)


def test_layers_and_arrows_counts_a_small_graph(tmp_path):
  (tmp_path / "a.py").write_text("from verifier import b\n")
  (tmp_path / "b.py").write_text("def f():\n  from verifier.c import x\n")
  (tmp_path / "c.py").write_text("import os\n")
  assert layers_and_arrows(tmp_path) == (3, 2)
  (tmp_path / "c.py").write_text("from verifier import a\n")
  try:
    layers_and_arrows(tmp_path)
  except ValueError as e:
    assert "import cycle" in str(e)
  else:
    raise AssertionError("a cycle was not found")


if __name__ == "__main__":
  import sys

  floors, arrows = layers_and_arrows(
    pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "verifier")
  )
  print(f"import floors {floors}, arrows {arrows}")
