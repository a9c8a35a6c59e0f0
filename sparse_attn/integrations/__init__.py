"""Integrations with other libraries, each imported on demand (``sparse_attn.integrations.transformers``)."""
