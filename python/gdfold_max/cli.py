"""The ``gdfold-max`` command line (also ``python -m gdfold_max``)."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from max.dtype import DType

app = typer.Typer(help="gdfold_max: the bit-exact speculative-decoding state fold for Gated DeltaNet, on MAX.",
                  no_args_is_help=True, add_completion=False)
console = Console()


class Target(StrEnum):
    cpu = "cpu"
    gpu = "gpu"


class GateName(StrEnum):
    head = "head"
    channel = "channel"


GATE_HELP = ("head: one decay per head (Qwen3-Next-80B's 36 layers); channel: per-channel gates"
             " (Kimi-Linear-48B's 20 KDA layers, 32 heads of 128; on a GPU MAX's kda_decode is the anchor).")


def _state_dtypes(dtypes: str) -> list[DType]:
    """The pool dtypes that ``--dtypes`` names, comma-separated; any other name is refused."""
    from .eager.base import state_dtype_named

    named = []
    for name in dtypes.split(","):
        try:
            named.append(state_dtype_named("--dtypes", name))
        except ValueError:
            raise typer.BadParameter(f"{name!r} is not float32 or bfloat16", param_hint="--dtypes") from None
    return named


def _bits(array: np.ndarray) -> np.ndarray:
    """The raw bit pattern of a float32 or bfloat16 array."""
    return array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint32)


@app.command()
def demo(
    batch: Annotated[int, typer.Option(help="Requests in the batch.")] = 2,
    state_dtype: Annotated[str, typer.Option(help="Pool dtype: float32 or bfloat16.")] = "float32",
    device: Annotated[Target, typer.Option(help="Where to fold.")] = Target.cpu,
    seed: Annotated[int, typer.Option(help="Random seed of the case.")] = 0,
) -> None:
    """Fold a random verify step with Qwen3-Next shapes, check it bit for bit, print speed.

    36 layers, nv 32, nk 16, K = V = 128, RING_LEN 4, a verify of 3 drafts. The numpy
    reference writes the records and runs the forward over the accepted tokens alone;
    the fold must reproduce that pool bit for bit.
    """
    from . import cases
    from .eager.fold import folder_for

    console.print(f"[bold]making the case[/]: 36 layers x batch {batch}, numpy reference verify ...")
    case = cases.spec_decode_case(seed, layers=36, batch=batch, num_value_heads=32, num_key_heads=16,
                                  key_dim=128, value_dim=128, ring_len=4, verify_width=3, state_dtype=state_dtype)
    folder = folder_for(device.value)
    state, ring, row_ids, ring_row_ids, accepted = case.fold_operands()
    start = time.perf_counter()
    folder.fold(state, ring, row_ids, ring_row_ids, accepted)  # compiles on first use
    first = time.perf_counter() - start
    exact = np.array_equal(_bits(state), _bits(case.state_out))
    timed = case.state_in.copy()
    start = time.perf_counter()
    folder.fold(timed, ring, row_ids, ring_row_ids, accepted)
    seconds = time.perf_counter() - start
    active = int(np.count_nonzero((accepted > 0) & (accepted <= ring.shape[2])))
    moved = 2 * active * row_ids.shape[0] * state[0].nbytes  # each folded row read and written once
    console.print(f"num_accepted = {accepted.tolist()}  ({active} of {batch} requests fold)")
    console.print(f"first call (compile + fold): {first:.1f} s")
    console.print(f"fold: {seconds * 1e3:.2f} ms, {moved / seconds / 1e9:.2f} GB/s of state read+write "
                  "(one eager call, host-side checks included)")
    console.print("[green]bit-exact against the reference forward over the accepted tokens[/]" if exact
                  else "[red]MISMATCH against the reference[/]")
    raise typer.Exit(0 if exact else 1)


@app.command()
def check(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A recorded case (.npz).")],
    device: Annotated[Target, typer.Option(help="Where to fold.")] = Target.cpu,
) -> None:
    """Fold a recorded case and compare every (layer, request) row with state_out, bit for bit.

    Exits 0 only when every row matches.
    """
    from .cases import FoldCase
    from .eager.fold import folder_for

    case = FoldCase.load(path)
    state, ring, row_ids, ring_row_ids, accepted = case.fold_operands()
    folder_for(device.value).fold(state, ring, row_ids, ring_row_ids, accepted)
    table = Table(title=f"{path.name} on {device.value}")
    for column in ("layer", "request", "row", "accepted", "match", "elements differing", "largest difference"):
        table.add_column(column, justify="right")
    all_match = True
    for layer in range(row_ids.shape[0]):
        for b in range(row_ids.shape[1]):
            row = int(row_ids[layer, b])
            got, want = state[row], case.state_out[row]
            differ = _bits(got) != _bits(want)
            count = int(np.count_nonzero(differ))
            largest = float(np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if count else 0.0
            all_match &= count == 0
            table.add_row(str(layer), str(b), str(row), str(int(accepted[b])),
                          "[green]yes[/]" if count == 0 else "[red]no[/]", str(count), f"{largest:.3g}")
    untouched = np.setdiff1d(np.arange(state.shape[0]), row_ids.reshape(-1))
    others_ok = np.array_equal(_bits(state[untouched]), _bits(case.state_out[untouched]))
    all_match &= others_ok
    console.print(table)
    console.print(f"rows no (layer, request) names: {'unchanged' if others_ok else '[red]CHANGED[/]'}")
    console.print("[green]all rows match bit for bit[/]" if all_match else "[red]mismatch[/]")
    raise typer.Exit(0 if all_match else 1)


@app.command()
def record(
    output: Annotated[Path, typer.Argument(dir_okay=False, help="Where to write the case (.npz).")],
    layers: Annotated[int, typer.Option(help="Gated-delta layers.")] = 2,
    batch: Annotated[int, typer.Option(help="Requests.")] = 4,
    num_value_heads: Annotated[int, typer.Option("--nv", help="Value heads.")] = 4,
    num_key_heads: Annotated[int, typer.Option("--nk", help="Key heads.")] = 2,
    key_dim: Annotated[int, typer.Option("--k", help="Key head dim K.")] = 64,
    value_dim: Annotated[int, typer.Option("--v", help="Value head dim V.")] = 64,
    ring_len: Annotated[int, typer.Option(help="Records per ring row.")] = 4,
    verify_width: Annotated[int, typer.Option(help="Drafts per verify (window = drafts + 1).")] = 3,
    state_dtype: Annotated[str, typer.Option(help="Pool dtype: float32 or bfloat16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write a recorded case made by the numpy reference (verify, then forward over the kept tokens)."""
    from . import cases

    case = cases.spec_decode_case(seed, layers=layers, batch=batch, num_value_heads=num_value_heads,
                                  num_key_heads=num_key_heads, key_dim=key_dim, value_dim=value_dim,
                                  ring_len=ring_len, verify_width=verify_width, state_dtype=state_dtype)
    if state_dtype == "bfloat16":  # npz keeps bf16 as its uint16 bits
        case.state_in, case.state_out = case.state_in.view(np.uint16), case.state_out.view(np.uint16)
    case.save(output)
    console.print(f"wrote {output} (num_accepted {case.num_accepted.tolist()})")


@app.command()
def bench(
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes (CPU default: 1,8).")] = "1,8,64,256",
    dtypes: Annotated[str, typer.Option(help="State dtypes.")] = "float32,bfloat16",
    chain: Annotated[int, typer.Option(help="Folds chained in the long graph.")] = 8,
    repeats: Annotated[int, typer.Option(help="Timed runs per graph; the best counts.")] = 5,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the table as JSON.")] = Path(
        "bench-results.json"
    ),
    gate: Annotated[GateName, typer.Option(help=GATE_HELP)] = GateName.head,
) -> None:
    """Time our fold beside MAX's built-in fold (GPU) or a numpy copy (CPU), Qwen3-Next shapes."""
    from max.driver import accelerator_count

    from .bench.fold import render, run_bench
    from .bench.harness import FoldShape, write_json

    batch_list = [int(b) for b in batches.split(",")]
    if accelerator_count() == 0 and batches == "1,8,64,256":
        batch_list = [1, 8]
    dtype_list = _state_dtypes(dtypes)
    rows = run_bench(batch_list, dtype_list, chain=chain, repeats=repeats, console=console,
                     shape=FoldShape.for_gate(gate.value))
    render(rows, console)
    write_json(rows, str(json_out))
    console.print(f"wrote {json_out}")


@app.command("bench-step")
def bench_step(
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8,64,256",
    dtypes: Annotated[str, typer.Option(help="State dtypes.")] = "float32",
    chain: Annotated[int, typer.Option(
        help="Steps timed against one: replays of the one-step graph back to back, or with --no-replay"
             " steps chained in the long graph.")] = 3,
    repeats: Annotated[int, typer.Option(help="Timed runs per graph; the best counts.")] = 5,
    rounds: Annotated[int, typer.Option(help="Rounds of every variant in turn; the median counts.")] = 1,
    column_tile: Annotated[int | None, typer.Option(help="Value columns per GPU block of our verify.")] = None,
    requests_per_block: Annotated[int | None, typer.Option(
        help="Units of work (a request on one column tile of one value head) per GPU block of our verify.")] = None,
    gpu_path: Annotated[str, typer.Option(
        help="Our window kernel on the GPU: auto (picked per launch), latency or throughput.")] = "auto",
    device: Annotated[Target, typer.Option(
        help="gpu: MAX's ops (its verify and fold, its forward), ours, ours fused, our forward, and FLA where"
             " torch and fla import;"
             " cpu: ours, ours fused, our forward.")] = (
        Target.gpu
    ),
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the table as JSON.")] = Path(
        "bench-step-results.json"
    ),
    replay: Annotated[bool, typer.Option(
        help="GPU: time captured device graphs (as MAX's pipelines decode); --no-replay times execute().")] = True,
    gate: Annotated[GateName, typer.Option(help=GATE_HELP)] = GateName.head,
    window: Annotated[int, typer.Option(
        help="Tokens each request verifies (RING_LEN): 1 is plain decoding, 8 a DFlash2 block, 32 the longest"
             " ring.")] = 4,
    tree: Annotated[str | None, typer.Option(
        help="Comma-separated token trees NODESxDEPTH (e.g. 8x4,16x5): time our tree verify against the chain of"
             " the tree's depth and against each root-to-leaf path as its own chain, all with fold on load,"
             " instead of the window table.")] = None,
    tree_variants: Annotated[str | None, typer.Option(
        help="With --tree: comma-separated variants to compile and time (default: all of tree,"
             " tree-shared-leaves, tree-throughput, chain, chain-latency, chain-nodes, paths); a ratio to a"
             " variant left out is"
             " not shown.")] = None,
) -> None:
    """Time one decoding step (verify of every layer + fold): MAX's ops, ours, ours fused, our forward, FLA."""
    from max.driver import CPU, accelerator_count

    from .bench.harness import FoldShape, write_json
    from .bench.step import WINDOWS, render_steps, run_step_bench
    from .ops.window import GPU_PATHS, WindowTiling

    dtype_list = _state_dtypes(dtypes)
    if device == Target.gpu and accelerator_count() == 0:
        console.print("bench-step needs a GPU for MAX's verify and fold, which have no CPU path;"
                      " --device cpu times ours and ours fused alone")
        raise typer.Exit(2)
    batch_list = [int(b) for b in batches.split(",")]
    if gpu_path not in GPU_PATHS:
        raise typer.BadParameter(f"{gpu_path!r} is not one of {', '.join(GPU_PATHS)}", param_hint="--gpu-path")
    tiling: WindowTiling = {"column_tile": column_tile, "requests_per_block": requests_per_block,
                            "gpu_path": gpu_path}
    if rounds < 1:
        raise typer.BadParameter(f"{rounds} is not at least 1", param_hint="--rounds")
    if window not in WINDOWS:
        raise typer.BadParameter(f"{window} is not in 1 to {WINDOWS[-1]}", param_hint="--window")
    target = CPU() if device == Target.cpu else None
    if tree_variants is not None and tree is None:
        raise typer.BadParameter("--tree-variants chooses among the variants of --tree; give --tree too",
                                 param_hint="--tree-variants")
    if tree is not None:
        from .bench.tree import TREE_VARIANTS, TreeShape, check_tree_variants, render_tree_rows, run_tree_bench

        if gpu_path != "auto" or column_tile is not None or requests_per_block is not None or not replay:
            raise typer.BadParameter("--tree times the tree verify on the latency kernel and chains on each kernel;"
                                     " it takes no --gpu-path, --column-tile, --requests-per-block or --no-replay",
                                     param_hint="--tree")
        try:
            shapes = list(dict.fromkeys(TreeShape.parse(text) for text in tree.split(",")))
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--tree") from None
        try:
            variants = (TREE_VARIANTS if tree_variants is None
                        else check_tree_variants(v.strip() for v in tree_variants.split(",")))
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--tree-variants") from None
        tree_rows = run_tree_bench(shapes, batch_list, dtype_list, shape=FoldShape.for_gate(gate.value), chain=chain,
                                   repeats=repeats, rounds=rounds, console=console, device=target, variants=variants)
        render_tree_rows(tree_rows, console)
        write_json(tree_rows, str(json_out))
        console.print(f"wrote {json_out}")
        return
    rows = run_step_bench(batch_list, dtype_list, chain=chain, repeats=repeats, rounds=rounds, tiling=tiling,
                          console=console, replay=replay, shape=FoldShape.for_gate(gate.value),
                          device=target, window=window)
    render_steps(rows, console)
    write_json(rows, str(json_out))
    console.print(f"wrote {json_out}")


@app.command("bench-shards")
def bench_shards(
    shards: Annotated[int, typer.Option(help="Devices, one shard each: the heads split evenly over them.")] = 2,
    batches: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "64,256",
    dtypes: Annotated[str, typer.Option(help="State dtypes.")] = "float32",
    chain: Annotated[int, typer.Option(help="Steps chained in the long graph, timed against one.")] = 3,
    repeats: Annotated[int, typer.Option(help="Timed runs per graph; the best counts.")] = 5,
    rounds: Annotated[int, typer.Option(help="Rounds of both variants in turn; the median counts.")] = 1,
    device: Annotated[Target, typer.Option(
        help="gpu: shard i on GPU i; cpu: every shard on the CPU, one after another (checks the graphs run,"
             " not the claim).")] = Target.gpu,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the table as JSON.")] = Path(
        "bench-shards-results.json"
    ),
) -> None:
    """Time a decoding step on tensor-parallel shards (one per device) against one shard alone on one device."""
    from max.driver import CPU, Accelerator, Device, accelerator_count

    from .bench.harness import FoldShape, write_json
    from .bench.shards import render_shard_rows, run_shard_bench, shard_shape

    dtype_list = _state_dtypes(dtypes)
    batch_list = [int(b) for b in batches.split(",")]
    if rounds < 1:
        raise typer.BadParameter(f"{rounds} is not at least 1", param_hint="--rounds")
    if chain < 2:
        raise typer.BadParameter(f"{chain} is not at least 2", param_hint="--chain")
    try:
        shard_shape(FoldShape(), shards)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--shards") from error
    if device == Target.gpu and accelerator_count() < shards:
        console.print(f"--shards {shards} needs {shards} GPUs; {accelerator_count()} here (--device cpu runs every"
                      " shard on the CPU)")
        raise typer.Exit(2)
    devices: list[Device] = [CPU()] * shards if device == Target.cpu else [Accelerator(i) for i in range(shards)]
    rows = run_shard_bench(devices, batch_list, dtype_list, chain=chain, repeats=repeats, rounds=rounds,
                           console=console)
    render_shard_rows(rows, console)
    write_json(rows, str(json_out))
    console.print(f"wrote {json_out}")


def main() -> None:
    app()
