"""Switches for running gdfold_max's ops inside other projects' model code.

* :mod:`gdfold_max.integrations.max_qwen3_5`: MAX's own Qwen3.5 speculative pipeline
  (``max.pipelines.architectures.unified_mtp_qwen3_5``). It needs MAX's ``serve``
  extra (``pip install 'gdfold_max[max-pipelines]'``); importing this package does not.
"""
