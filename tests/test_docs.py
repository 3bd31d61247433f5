"""The code in README.md and docs/*.md runs.

Every ```python block is marked, on the line just before it, with one of:

* ``<!-- run -->``: executed as a script in one process;
* ``<!-- run: nproc=N -->``: executed on N processes by torch's launcher (``torchrun``), so it
  calls ``dist.init_process_group("gloo")`` as a user's script does;
* ``<!-- fragment -->``: a piece of a program (it needs a model or a mesh the text talks about);
  not executed.

An unmarked python block fails the test, so an example cannot silently stop being checked.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
import sys
from typing import List, NamedTuple, Optional

import pytest

from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = re.compile(r"<!--\s*(run(?::\s*nproc=(\d+))?|fragment)\s*-->")
TIMEOUT = 600


class Block(NamedTuple):
    path: str
    line: int
    kind: Optional[str]      # "run", "fragment" or None (unmarked)
    nproc: int
    code: str

    @property
    def id(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def _doc_files() -> List[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _blocks() -> List[Block]:
    out = []
    for path in _doc_files():
        lines = open(path, encoding="utf-8").read().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip().startswith("```python"):
                j = i - 1
                while j >= 0 and not lines[j].strip():
                    j -= 1
                m = MARK.search(lines[j]) if j >= 0 else None
                k = i + 1
                while k < len(lines) and not lines[k].strip().startswith("```"):
                    k += 1
                kind = None if m is None else ("fragment" if m.group(1) == "fragment" else "run")
                nproc = int(m.group(2)) if m is not None and m.group(2) else 1
                out.append(Block(path, i + 1, kind, nproc, "\n".join(lines[i + 1:k]) + "\n"))
                i = k
            i += 1
    return out


BLOCKS = _blocks()


def test_every_python_block_is_marked():
    unmarked = [b.id for b in BLOCKS if b.kind is None]
    assert not unmarked, ("python blocks without <!-- run -->, <!-- run: nproc=N --> or "
                          f"<!-- fragment --> on the line before: {unmarked}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=lambda b: b.id)
def test_runnable_block(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "examples"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    if block.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(block.nproc), "--master-port", str(_free_port()), str(script)]
    else:
        cmd = [sys.executable, str(script)]
    try:
        proc = run_command(cmd, cwd=tmp_path, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id}: did not finish within {TIMEOUT} s\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (f"{block.id} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
