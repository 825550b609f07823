"""The graph-level ops: the only door from a MAX graph to the gdfold kernels.

* :mod:`.kernels`: ``kernels_path()``, the Mojo package to pass to
  ``Graph(..., custom_extensions=[...])``, and the names the ops are registered under;
* :mod:`.fold`: ``state_fold`` and the fold's GPU tiling;
* :mod:`.window`: ``verify_ring`` (optionally folding on load), ``verify_tree`` (token
  trees) and ``recurrence``, and the window kernels' GPU tiling and paths;
* :mod:`.checks`: the build-time checks those share (shapes, dtypes, the ring, row tables);
* :mod:`.shared_memory`: a GPU window block's shared memory, counted as the kernel counts it.

This ``__init__`` imports nothing, so ``gdfold_max.ops.kernels`` loads without MAX; the
public names are ``gdfold_max.state_fold``, ``gdfold_max.verify_ring`` and so on.
"""
