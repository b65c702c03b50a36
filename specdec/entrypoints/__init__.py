"""Entry points: the ``specdec`` CLI, ``serve``, ``generate``, the health probe (the only code that knows every service)."""
