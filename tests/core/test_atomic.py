"""dice_jax.atomic: whole-or-nothing writes with the permissions of ordinary files."""

import os
import stat

import pytest

from dice_jax import atomic


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_written_file_and_directory_get_umask_permissions(tmp_path, umask_022):
  f = atomic.write_text(str(tmp_path / "a.txt"), "hello")
  assert open(f).read() == "hello" and _mode(f) == 0o644
  with atomic.new_directory(str(tmp_path / "out")) as d:
    atomic.write_json(os.path.join(d, "x.json"), {"k": 1})
  assert _mode(tmp_path / "out") == 0o755 and _mode(tmp_path / "out" / "x.json") == 0o644
  assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "m.json")
  atomic.write_json(path, {"v": 1})

  def boom(tmp):
    open(tmp, "w").write("partial")
    raise RuntimeError("disk full")

  with pytest.raises(RuntimeError, match="disk full"):
    atomic.write_file(path, boom)
  assert open(path).read() == '{"v": 1}' and os.listdir(tmp_path) == ["m.json"]


def test_failed_directory_leaves_nothing_and_existing_one_needs_overwrite(tmp_path):
  out = str(tmp_path / "export")
  with pytest.raises(ValueError, match="bad tensor"):
    with atomic.new_directory(out) as d:
      atomic.write_text(os.path.join(d, "half.bin"), "x")
      raise ValueError("bad tensor")
  assert os.listdir(tmp_path) == []
  with atomic.new_directory(out) as d:
    atomic.write_text(os.path.join(d, "v1"), "1")
  with pytest.raises(FileExistsError, match="export already exists"):
    with atomic.new_directory(out):
      pass
  with atomic.new_directory(out, overwrite=True) as d:
    atomic.write_text(os.path.join(d, "v2"), "2")
  assert os.listdir(out) == ["v2"] and os.listdir(tmp_path) == ["export"]


def test_temporary_keeps_the_extension(tmp_path):
  seen = []
  atomic.write_file(str(tmp_path / "loss.png"), lambda tmp: (seen.append(tmp), open(tmp, "w")))
  assert seen[0].endswith("loss.png") and os.path.basename(seen[0]).startswith(".tmp-")
