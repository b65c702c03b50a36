"""The execution core: everything that runs a model.

KV block pool and prefix cache (``block_pool``, ``kv_cache``), the model runner (``runner``), the lean
forward (``lean_decoder``, ``lean_gemma3``, ``lean_linear``), paged attention (``attention``), model
loading (``models``) and the draft/target workers (``workers``). The decoding algorithm (the loop,
proposals, rejection, sampling, seeding, n-gram, adaptive k) sits beside it in ``specdec``.
"""
