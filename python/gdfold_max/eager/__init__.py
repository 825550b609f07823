"""The eager entry points: numpy arrays (or MAX ``Buffer``) in, compiled and cached
graphs of the ops of :mod:`gdfold_max.ops` underneath.

* :mod:`.fold`: ``StateFolder``, ``folder_for`` and ``fold``, the eager fold;
* :mod:`.window`: ``WindowRunner`` and ``runner_for``, the eager verify and forward;
* :mod:`.base`: what they share (device resolution, host-side checks, the graph cache,
  the upload / execute / copy-back sequence).

This ``__init__`` imports nothing (a name here would clash with the submodule ``fold``);
the public names are ``gdfold_max.fold``, ``gdfold_max.StateFolder`` and so on.
"""
