"""Imports: no module that reaches the process, the network, frames, threads or this verifier.

KernelBench's STRICT ``thread_injection`` check and the import hacks kernel-RL projects reported
(``gc`` to find the reference's outputs, ``ctypes`` and ``subprocess`` to leave the sandbox).
"""

from __future__ import annotations

import ast

from verifier.api.contract import FailureKind, Strictness
from verifier.static.rules.base import Findings, Rejection, Rule
from verifier.static.source import Candidate
from verifier.static.syntax import imported_modules, node_line

# Modules a candidate may not import. Introspection, native access, file writing, processes, networking,
# persistence and this verifier itself (KernelBench's STRICT list plus the hacks kernel-RL projects reported).
FORBIDDEN_MODULES = frozenset(
  {
    "gc",
    "ctypes",
    "cffi",
    "subprocess",
    "_posixsubprocess",
    "socket",
    "socketserver",
    "ssl",
    "select",
    "selectors",
    "http",
    "urllib",
    "requests",
    "ftplib",
    "smtplib",
    "signal",
    "importlib",
    "builtins",
    "pickle",
    "marshal",
    "shelve",
    "dbm",
    "sqlite3",
    "copyreg",
    "dill",
    "cloudpickle",
    "shutil",
    "sys",
    "code",
    "codeop",
    "pty",
    "tty",
    "termios",
    "mmap",
    "faulthandler",
    "tracemalloc",
    "pathlib",
    "io",
    "_io",
    "tempfile",
    "fcntl",
    "posix",
    "resource",
    "atexit",
    "runpy",
    "zipimport",
    "site",
    "platform",
    "webbrowser",
    "logging",
    "zipfile",
    "tarfile",
    "weakref",
    "dis",
    "types",
    "verifier",
  }
)

FORBIDDEN_TORCH_MODULES = (
  "torch.multiprocessing",
  "torch.distributed",
  "torch.library",
  "torch.overrides",
  "torch.utils._python_dispatch",
  "torch._C",
  "torch._dynamo",
  "torch.hub",
)

FRAME_MODULES = frozenset({"inspect", "traceback"})

THREAD_MODULES = frozenset({"threading", "multiprocessing", "concurrent", "asyncio", "_thread"})

# os functions that write files, change the process tree or signal anything.
OS_FORBIDDEN = frozenset(
  {
    "system",
    "popen",
    "fork",
    "forkpty",
    "kill",
    "killpg",
    "abort",
    "_exit",
    "execv",
    "execve",
    "execvp",
    "execvpe",
    "execl",
    "execle",
    "execlp",
    "execlpe",
    "spawnl",
    "spawnle",
    "spawnlp",
    "spawnv",
    "spawnve",
    "spawnvp",
    "posix_spawn",
    "posix_spawnp",
    "setsid",
    "setpgid",
    "setpgrp",
    "putenv",
    "unsetenv",
    "open",
    "fdopen",
    "write",
    "writev",
    "pwrite",
    "sendfile",
    "remove",
    "unlink",
    "rmdir",
    "removedirs",
    "rename",
    "renames",
    "replace",
    "mkdir",
    "makedirs",
    "mkfifo",
    "mknod",
    "symlink",
    "link",
    "truncate",
    "ftruncate",
    "chmod",
    "fchmod",
    "chown",
    "fchown",
    "lchown",
    "utime",
    "chdir",
    "fchdir",
    "chroot",
    "dup",
    "dup2",
    "pipe",
    "pipe2",
    "openpty",
    "memfd_create",
    "pidfd_open",
    "register_at_fork",
    "nice",
    "sched_setaffinity",
    "setuid",
    "setgid",
  }
)


def _import_rules(tree: ast.AST, strictness: Strictness) -> Rejection | None:
  for node in ast.walk(tree):
    for m in imported_modules(node):
      root, line = m.split(".")[0], node_line(node)
      if root in THREAD_MODULES and strictness.forbid_threads_streams:
        return Rejection(
          FailureKind.THREAD_OR_STREAM,
          f"imports {m!r} (line {line}): extra threads/processes are not allowed",
        )
      if not strictness.forbid_imports:
        continue
      if root in FRAME_MODULES:
        return Rejection(
          FailureKind.FRAME_INTROSPECTION,
          f"imports {m!r} (line {line}): frame and stack introspection is not allowed",
        )
      if root in FORBIDDEN_MODULES or any(
        m == t or m.startswith(t + ".") for t in FORBIDDEN_TORCH_MODULES
      ):
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT, f"imports {m!r} (line {line}), which is not allowed"
        )
      if root == "os" and m.split(".")[-1] in OS_FORBIDDEN | {"*"}:  # from os import *: all of them
        return Rejection(
          FailureKind.FORBIDDEN_IMPORT,
          f"imports {m!r} (line {line}): file writing and process control are not allowed",
        )
  return None


def imports_rule(c: Candidate, strictness: Strictness) -> Findings:
  """No import of modules that reach the process, the network, the profiler or frames (the strictness
  decides which lists apply): a candidate must compute, not inspect or escape."""
  return [r for r in [_import_rules(c.tree, strictness)] if r]


RULES = (Rule("imports", imports_rule),)
