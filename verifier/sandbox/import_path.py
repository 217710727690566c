"""Where the service's child processes import this ``verifier`` package from.

Checkers, fork servers and static-check processes start in scratch directories of their own, so an
import path that works in the caller's directory (``PYTHONPATH=.`` in a checkout where the project is
not pip-installed) would point into the scratch directory there. Children therefore get the directory
this package is imported from (unless it is a site-packages directory, where they find it anyway),
then the caller's ``PYTHONPATH`` with every entry made absolute against the caller's working directory.
"""

from __future__ import annotations

import os
import pathlib
import site

# The directory holding the ``verifier`` package: the checkout (or site-packages when installed).
IMPORT_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def child_pythonpath(pythonpath: str | None = None) -> str:
  """``IMPORT_ROOT`` (left out when installed), then each entry of ``pythonpath`` (default: this
  process's ``PYTHONPATH``) as an absolute path, without repeats, joined with ``os.pathsep``."""
  if pythonpath is None:
    pythonpath = os.environ.get("PYTHONPATH", "")
  installed = {os.path.realpath(p) for p in site.getsitepackages()}
  root = [] if os.path.realpath(IMPORT_ROOT) in installed else [IMPORT_ROOT]
  entries = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
  return os.pathsep.join(dict.fromkeys([*root, *entries]))
