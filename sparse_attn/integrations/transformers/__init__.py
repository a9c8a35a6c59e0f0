"""Hugging Face ``transformers`` integration: ``attn_implementation="sparse_attn"`` and long-document conversion.

>>> import sparse_attn as sa
>>> from sparse_attn.integrations.transformers import register, to_long_model
>>> from transformers import AutoModel, BertConfig
>>> register(pattern=sa.Local(64) | sa.Global(first=1))              # once per process
'sparse_attn'
>>> config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
>>> model = AutoModel.from_config(config, attn_implementation="sparse_attn")
>>> model = to_long_model(model, max_positions=4096, pattern=sa.Local(128) | sa.Global(first=1))
>>> model.config.max_position_embeddings
4096

Which pattern a model uses: ``model.config.sparse_attn_pattern`` (a ``Pattern.to_dict()`` dict, saved
with the config by ``save_pretrained``) when set, else the pattern given to ``register`` for the
model's ``attn_implementation`` name, else the model's own sliding windows where its config has them
(:func:`own_patterns`), else ``DEFAULT_PATTERN`` = ``Local(256) | Global(first=1)`` (Longformer's
``attention_window=512`` with a global first token), with a warning when the model is built. Register
several names to bind several patterns. Only the padding mask, causality and packed documents come from
the model: the model's own mask function (sliding windows, prefix-LM) is replaced by the pattern. In a
left-padded batch the pattern's positions count from each row's first token (as the model's
``position_ids`` do), so a row computes what its prompt alone computes.

Importing this package wraps transformers' check of a model's ``attn_implementation`` (``build_hook``,
the one place that touches a transformers private): a model loaded with ``from_pretrained(path)`` whose
saved config holds ``sparse_attn_pattern`` runs ``"sparse_attn"`` again, and a sparse_attn-like name that
was never given to :func:`register` raises an error saying so.

Packed batches (``DataCollatorWithFlattening``: one row whose ``position_ids`` restart at each
document, and with ``return_flash_attn_kwargs=True`` its ``cu_seq_lens_q/k``) run every document as a
sequence by itself (sparse_attention's ``documents=``, from :func:`packed_documents`): the pattern
applies per document, ``Global(first=1)`` is each document's first token, nothing crosses documents.
Decoders (Llama, ...) and encoders (BERT, RoBERTa, ...) hand the attention the ``position_ids`` they
are called with. Packed batches with a KV cache are refused at the cached step.

Generation in bounded memory: ``model.generate(..., cache=SparseCache(model))`` (``past_key_values=`` before
transformers 5.24 renamed it: ``CACHE_KEYWORD`` is the installed one's) keeps, in each
layer, only the keys that layer's pattern can still reach (:class:`SparseCache`); the attention function
finds the absolute positions of the keys it receives through :class:`SparseCacheLayer` (``cache.held_keys``).

Score modifiers a model hands its attention function run in sparse_attention: Gemma 2's ``softcap=``
(``attn_logit_softcapping``) and gpt-oss's ``s_aux=`` (one learned sink per query head) become its
``softcap=`` and ``sinks=``, in the prefill and in every cached step (``attention._score_mods``); with their
sliding-window and full layers each running the model's own attention (:func:`own_patterns`) these models
compute what their eager attention computes.

Models that sparse_attn cannot run are refused when they are built with a registered name: models
whose layers compute attention themselves instead of calling transformers' ``AttentionInterface``
(Longformer, BigBird, DeBERTa, ALiBi models such as BLOOM and MPT, ...) and encoder-decoder models (their
cross-attention relates two sequences). What the attention function is handed and sparse_attn does not
compute is refused at the first forward (``attention._NOT_COMPUTED``): a position-bias tensor (T5-style
``position_bias=``), sinks computed per token (``sinks=``, or an ``s_aux`` that is not one per head) and an
indexer's choice of keys (``indices=``, ``block_indices=``: DeepSeek V3.2-style sparse attention).

Under ``torch.compile`` a call with no padding mask reads no tensor's values (``fullgraph=True`` works): the
positions' restarts that mark a packed batch are checked inside the graph, and a packed batch raises when the
graph runs unless ``cu_seq_lens_q/k`` say where its documents are (see :func:`packed_documents`).

The package, one module per job: ``registry`` (the names given to ``register``, the pattern of each layer),
``masks`` (the padding mask and packed documents a model hands the attention), ``cache`` (``SparseCache``),
``attention`` (the attention function, ``register``, ``to_long_model``), ``model_checks`` (the models it
refuses) and ``build_hook`` (the patch of transformers' private check that runs them).
"""
from .attention import register, requested_implementation, to_long_model
from .build_hook import wrap_attn_implementation_check
from .cache import CACHE_KEYWORD, SparseCache, SparseCacheLayer
from .masks import first_tokens, packed_documents, padding_mask
from .model_checks import check_built_model, check_model
from .registry import DEFAULT_PATTERN, model_pattern, own_patterns

__all__ = ["CACHE_KEYWORD", "DEFAULT_PATTERN", "SparseCache", "SparseCacheLayer", "check_model", "first_tokens",
           "model_pattern", "own_patterns", "packed_documents", "padding_mask", "register", "to_long_model"]

wrap_attn_implementation_check(requested_implementation, check_built_model)
