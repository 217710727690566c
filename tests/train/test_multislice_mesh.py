"""The multi-slice mesh on 8 CPU devices: the data axis crosses slices (its outer factor), fsdp,
tensor and the rest of data stay inside one slice; `run.mesh_slices` selects it."""

import dataclasses

import jax
import numpy as np
import pytest

from dice_jax import sharding
from dice_jax.train import run_setup
from dice_jax.train.run_config import RunConfig


def _slice_of(mesh, slices):
  """Slice of each mesh position, where a slice is a contiguous run of the 8 devices."""
  per = len(jax.devices()) // slices
  return np.vectorize(lambda d: d.id // per)(mesh.devices)


@pytest.mark.parametrize(
  "data, fsdp, tensor, slices",
  [(2, 2, 2, 2), (2, 4, 1, 2), (4, 2, 1, 2), (4, 1, 2, 4), (8, 1, 1, 2)],
)
def test_only_the_outer_data_factor_crosses_slices(data, fsdp, tensor, slices):
  mesh = sharding.make_mesh(data, fsdp, tensor, slices=slices)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": data, "fsdp": fsdp, "tensor": tensor}
  where = _slice_of(mesh, slices)
  inner = data // slices
  for i in range(data):
    # data index i = slice (i // inner) x position inside it (i % inner): one slice per block
    assert (where[i] == i // inner).all(), (i, where)
  # every device once
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_one_slice_is_the_flat_layout():
  one = sharding.make_mesh(2, 2, 2)
  assert (one.devices == np.asarray(jax.devices()).reshape(2, 2, 2)).all()
  assert (sharding.make_mesh(2, 2, 2, slices=1).devices == one.devices).all()


def test_the_data_axis_must_hold_the_slices():
  with pytest.raises(
    ValueError, match=r"data axis \(1\) must be a multiple of the number of slices \(2\)"
  ):
    sharding.make_mesh(1, -1, 1, slices=2)
  with pytest.raises(ValueError, match=r"data axis \(2\) must be a multiple .* slices \(4\)"):
    sharding.make_mesh(2, 4, 1, slices=4)


@dataclasses.dataclass(frozen=True)
class _Dev:
  id: int
  process_index: int
  slice_index: int


def test_slices_are_grouped_by_slice_index_where_devices_have_one():
  # two slices of 4 whose devices come interleaved
  devs = [_Dev(i, i // 2, i % 2) for i in range(8)]
  groups = sharding.slice_groups(devs, 2)
  assert [[d.id for d in g] for g in groups] == [[0, 2, 4, 6], [1, 3, 5, 7]]
  with pytest.raises(ValueError, match="do not form 4 equal slices"):
    sharding.slice_groups(devs, 4)


def test_devices_without_a_slice_index_split_by_process():
  devs = [_Dev(i, 1 - i // 4, 0) for i in range(8)]
  plain = [type("D", (), {"id": d.id, "process_index": d.process_index})() for d in devs]
  groups = sharding.slice_groups(plain, 2)
  # process 0 holds devices 4..7: it is the first slice
  assert [[d.id for d in g] for g in groups] == [[4, 5, 6, 7], [0, 1, 2, 3]]
  with pytest.raises(ValueError, match="do not form 3 equal slices"):
    sharding.slice_groups(plain, 3)


def test_the_run_section_selects_the_slices():
  run = RunConfig(mesh_data=2, mesh_fsdp=-1, mesh_slices=2)
  mesh = run_setup.make_mesh(run)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  assert (_slice_of(mesh, 2)[0] == 0).all() and (_slice_of(mesh, 2)[1] == 1).all()
  with pytest.raises(
    ValueError, match=r"run.mesh_data \(1\) must be a multiple of run.mesh_slices"
  ):
    RunConfig(mesh_slices=2)
  with pytest.raises(ValueError, match="run.mesh_slices must be a positive int"):
    RunConfig(mesh_slices=0)
