"""Reference models, model builders and test / benchmark utilities for hcpasses (like ``torch.testing``).

- :mod:`hcpasses.testing.models`: plain eager reference models (the HC decoder, the DeepSeek-V4 mHC decoder,
  the MTP drafter, the hand-written SP baseline, the benchmark model), TP through ``torch.distributed``.
- :mod:`hcpasses.testing.hf_models`: tiny and real-size randomly initialised transformers HC models
  (qwen4_exp, deepseek_v4); needs transformers (the ``test`` extra).
- :mod:`hcpasses.testing.multiproc`: run a function on several ranks, one process each, with a deadline.
- :mod:`hcpasses.testing.demo`: ``python -m hcpasses.testing.demo``, the tiny HC model at TP 2 through the
  backend.

Nothing in hcpasses outside ``hcpasses.testing`` imports it (``tests/test_cli.py`` checks), so the backend
and its passes work where none of this is used. Importing this package imports none of its modules.
"""
