"""The benchmarks behind ``gdfold-max bench``, ``bench-step`` and ``bench-shards``: our ops
beside their anchors, timed side by side in one process.

* :mod:`.harness`: what they share (chained graphs, rounds, ratios, tables, JSON);
* :mod:`.fold`: the fold beside MAX's built-in fold (GPU) or a numpy copy (CPU);
* :mod:`.step`: one decoding step (verify of every layer + fold), MAX's ops, ours, ours
  fused, our forward, and FLA;
* :mod:`.shards`: a decoding step on tensor-parallel shards against one shard alone;
* :mod:`.fla`: FLA's fused recurrent kernel as an anchor (imports torch and fla only when asked).

Nothing in the product imports these: the CLI's bench commands import theirs when they
run, so ``import gdfold_max`` and ``gdfold_max.cli`` load no benchmark.
"""
