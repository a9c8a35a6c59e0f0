"""``python -m sparse_attn``: the ``sparse-attn`` command."""
import sys

from .cli import main

sys.exit(main())
