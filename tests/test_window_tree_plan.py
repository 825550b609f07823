"""The visiting order of the tree verify on the throughput kernel's blocks
(``plan_visits`` in mojo/window_gpu_tree.mojo), run by the Mojo compiler on the host and
compared with the order the latency kernel steps a tree in: first the leaves of the
committed state, then each node that is some node's parent in the window's order, each
followed by its own leaves; an inner node whose parent is not the inner node before it
reloads. Random forests, EAGLE-shaped trees, chains and trees listed level by level
(which reload), each planned by a block of three threads and of 32."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gdfold_max.cases import random_parents
from gdfold_max.ops.kernels import kernel_sources, mojo_compiler
from gdfold_max.trees import chain_parents, draft_tree

#: mojo/window_gpu_tree.mojo's visit bits.
KEEPS, RELOADS = 0x100, 0x200


def expected_visits(parents: list[int]) -> list[int]:
    """The latency kernel's order (step_leaves after each inner node), as visit entries."""
    window = len(parents)
    inner = {p for p in parents if p >= 0}
    order = [node for node in range(window) if node not in inner and parents[node] == -1]
    last = -1
    for node in sorted(inner):
        order.append(node | KEEPS | (RELOADS if parents[node] != last else 0))
        last = node
        order += [leaf for leaf in range(node + 1, window) if leaf not in inner and parents[leaf] == node]
    return order


def level_order_tree() -> list[int]:
    """Two levels of three children each under a root, listed level by level: nodes 2
    and 3 have children but come after node 1, whose own children come last."""
    return [-1, 0, 0, 0, 1, 2, 2, 3, 3, 1]


def trees() -> list[list[int]]:
    forests = [list(row[:window]) for seed in range(6)
               for row, window in zip(random_parents(seed, [32, 17, 6, 1, 0], 32), [32, 17, 6, 1, 0], strict=True)]
    drafts = [list(draft_tree(nodes, depth)) for nodes, depth in ((8, 4), (16, 5), (32, 6))]
    return [*forests, *drafts, list(chain_parents(1, 8)[0]), level_order_tree()]


def test_level_order_trees_reload() -> None:
    """The case the kernel must reload: an inner node whose parent is not the inner node
    visited before it."""
    visits = expected_visits(level_order_tree())
    assert [v & 0xFF for v in visits if v & RELOADS] == [2, 3]


@pytest.mark.parametrize("threads", [3, 32])
def test_plan_visits_lists_the_latency_kernel_order(tmp_path: Path, threads: int) -> None:
    found = mojo_compiler()
    if found is None:
        pytest.skip("no mojo compiler on this machine")
    (tmp_path / "gdfold").symlink_to(kernel_sources(), target_is_directory=True)
    cases = trees()
    lines = ["from std.memory import stack_allocation", "from gdfold.window_gpu_tree import plan_visits", "",
             "def plan(parents: List[Int]):",
             "    var table = stack_allocation[32, DType.int32]()",
             "    var visits = stack_allocation[32, DType.uint32]()",
             "    var inner = 0",
             "    for node in range(len(parents)):",
             "        table[unsafe_offset=node] = Int32(parents[node])",
             "        if parents[node] >= 0:",
             "            inner |= 1 << parents[node]",
             f"    for tid in range({threads}):",
             f"        plan_visits[{threads}](visits, table, inner, len(parents), tid)",
             "    for node in range(len(parents)):",
             "        print(Int(visits[unsafe_offset=node]), end=' ')",
             "    print('|')",
             "", "def main():"]
    for parents in cases:
        lines.append(f"    plan([{', '.join(str(int(p)) for p in parents)}])")
    program = tmp_path / "plan.mojo"
    program.write_text("\n".join(lines) + "\n")
    # The environment as Python holds it (tests/test_window_shared_memory.py says why).
    run = subprocess.run([found, "run", "-I", str(tmp_path), str(program)], env=dict(os.environ),
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    got = [[int(x) for x in chunk.split()] for chunk in run.stdout.split("|")[:-1]]
    assert len(got) == len(cases), run.stdout
    for parents, visits in zip(cases, got, strict=True):
        assert visits == expected_visits(list(map(int, parents))), parents
        assert sorted(v & 0xFF for v in visits) == list(range(len(parents)))
    assert any(v & RELOADS for visits in got for v in visits), "no case reloads"
