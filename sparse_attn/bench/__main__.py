"""``python -m sparse_attn.bench POINT_JSON``: the child process that measures one point (see ``harness``)."""
from .harness import child

child()
