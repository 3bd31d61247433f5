"""The code in README.md and docs/*.md runs.

Every ```python block is marked, on the line just before it, with one of:

* ``<!-- run -->``: executed as a script in one process;
* ``<!-- run: nproc=N -->``: executed on N processes as torch's launcher (``torchrun``) runs
  it, so it calls ``dist.init_process_group("gloo")`` as a user's script does;

(on the test harness's pooled ranks, with the environment ``torchrun`` or ``python`` gives the
script: ``harness.run_script``; with ``TPX_TEST_FRESH_RANKS=1`` under ``torchrun`` itself);
* ``<!-- fragment -->``: a piece of a program (it needs a model or a mesh the text talks about);
  not executed.

An unmarked python block fails the test, so an example cannot silently stop being checked.
"""

from __future__ import annotations

import glob
import os
import re
from typing import List, NamedTuple, Optional

import pytest

from harness import run_script

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


def _cannot_run_here(code: str) -> Optional[str]:
    """Why this installation cannot run an example, or ``None``: peft not installed (optional
    for tpx's users) for one that imports it; a torch before 2.13 for one that runs FSDP2 on
    CPU tensors (``torch_compat.needs_fsdp2_on_cpu``); a torch before 2.6 for one that loads
    an adapter into a TP model (``torch_compat.SHARD_HAS_LOCAL_SIZE``)."""
    import torch
    from torch_compat import SHARD_HAS_LOCAL_SIZE, needs_fsdp2_on_cpu

    if re.search(r"^\s*(import|from) peft\b", code, re.M):
        try:
            import peft  # noqa: F401
        except ImportError:
            return "peft is not installed"
        if "load_adapter(" in code and not SHARD_HAS_LOCAL_SIZE:
            return (f"transformers' adapter loading into DTensor parameters needs torch >= 2.6 "
                    f"(Shard.local_shard_size_and_offset); this is {torch.__version__}")
    if "fully_shard" in code and needs_fsdp2_on_cpu.mark.args[0]:
        return needs_fsdp2_on_cpu.mark.kwargs["reason"]
    return None


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=lambda b: b.id)
def test_runnable_block(block, tmp_path):
    reason = _cannot_run_here(block.code)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "example.py"
    script.write_text(block.code)
    run_script(str(script), block.nproc, cwd=str(tmp_path),
               paths=[os.path.join(ROOT, "examples")], timeout=TIMEOUT)


def test_scripts_run_as_the_launcher_runs_them(tmp_path):
    """harness.run_script, which runs the blocks: each rank runs the script as ``__main__`` in
    its directory with the launcher's environment and makes its own group; a rank's exception
    or non-zero exit fails the run, naming the rank."""
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys, torch.distributed as dist\n"
        "assert __name__ == '__main__' and sys.argv == [__file__]\n"
        "dist.init_process_group('gloo')\n"
        "assert (dist.get_rank(), dist.get_world_size()) == (int(os.environ['RANK']), 3)\n"
        "open(f'rank{dist.get_rank()}.txt', 'w').write(os.environ['LOCAL_WORLD_SIZE'])\n")
    run_script(str(script), 3, cwd=str(tmp_path))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)] == ["3"] * 3
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    with pytest.raises(AssertionError, match=r"failed on rank 1|rank *: 1 \(local_rank: 1\)"):
        run_script(str(script), 2, cwd=str(tmp_path))
    script.write_text("import os\nassert 'RANK' not in os.environ\nraise SystemExit(0)\n")
    run_script(str(script), 1, cwd=str(tmp_path))  # as `python s.py`: no launcher variables
