"""torch.compile with Inductor, the default backend, on small shapes: the function, the nn layer and a Hugging Face
Llama, forward and backward, with and without fullgraph=True, each against the same code run eagerly.

q, k, v come as the projections hand them over, (B, N, H, D) storage seen as (B, H, N, D): Inductor checks
that the kernels' outputs have the strides their fake kernels promise. A Pattern without call-time data is
built while Dynamo traces (one graph, fullgraph=True works), keyed by its value: an equal pattern made anew
every call, outside the compiled function or inside it, runs the same graph. Call-time masks are data, so
their layout is built on the host at run time, a graph break (and under fullgraph=True, an error that says
how to keep the graph whole). Inductor's graph caches are off here, so a graph compiled by an older checkout
is never what runs; tests that count graphs without checking Inductor's code compile with Dynamo alone.
"""
import gc
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_attn as sa
from sparse_attn import backends
from sparse_attn.compiler import LAYOUT_CACHE
from sparse_attn.nn import SparseSelfAttention
from tests.test_pattern_kinds import EXAMPLES, HEADS, N

BACKEND = "numba" if backends.availability("numba")[0] else "reference"
PATTERN = sa.Local(4) | sa.Global(first=1)         # built outside the compiled functions, as the docs say
TOLERANCE = dict(atol=1e-5, rtol=1e-5)             # float32: Inductor may fuse the projections differently


@pytest.fixture(autouse=True)
def fresh_compiles():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def inductor(fn, fullgraph: bool, backend: str = "inductor"):
    """``fn`` compiled by Inductor (or by Dynamo alone with ``backend="eager"``), and the counter of the graphs
    Dynamo hands it."""
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=fullgraph), counter


def attend_with(q, k, v, pattern):
    return sa.sparse_attention(q, k, v, pattern, backend=BACKEND)


def projected_qkv(batch=2, q_heads=2, kv_heads=1, n=40, head_dim=8, device="cpu"):
    """q (B, Hq, N, D), k, v (B, Hkv, N, D), each a transposed view of (B, N, H, D) storage."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((batch, n, q_heads, head_dim), (batch, n, kv_heads, head_dim), (batch, n, kv_heads, head_dim))
    qkv = [torch.randn(shape, generator=gen).to(device).transpose(1, 2) for shape in shapes]
    assert not qkv[0].is_contiguous()
    return qkv


def outputs_and_grads(fn, q, k, v, *args):
    """out, lse and the gradients of q, k, v of a loss over both, on fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, *args)
    (out.square().sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()).backward()
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("given", ["pattern", "layout"])
def test_function_is_one_graph_with_fullgraph(given):
    q, k, v = projected_qkv()
    pattern = PATTERN if given == "pattern" else PATTERN.layout(40, heads=2)

    def attend(q, k, v):
        return sa.sparse_attention(q, k, v, pattern, backend=BACKEND, return_lse=True)

    compiled, graphs = inductor(attend, fullgraph=True)
    for actual, expected in zip(outputs_and_grads(compiled, q, k, v), outputs_and_grads(attend, q, k, v)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1                  # the layout was found while tracing, outside the graph


def test_call_time_masks_break_the_graph_cleanly():
    q, k, v = projected_qkv()
    padding = torch.arange(40) >= torch.tensor([[40], [29]])                     # (B, N), True = padding

    def attend(q, k, v, padding):
        return sa.sparse_attention(q, k, v, PATTERN, key_padding_mask=padding, backend=BACKEND, return_lse=True)

    compiled, _ = inductor(attend, fullgraph=False)
    for actual, expected in zip(outputs_and_grads(compiled, q, k, v, padding),
                                outputs_and_grads(attend, q, k, v, padding)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable") as error:
        inductor(attend, fullgraph=True)[0](q, k, v, padding)
    assert "marked as skipped" not in str(error.value)


@pytest.mark.parametrize("data", ["key_padding_mask", "global_mask", "documents"])
def test_call_time_data_under_fullgraph_is_an_error_that_says_what_to_do(data):
    """Under fullgraph=True the graph break of call-time data is an error that names them and the fix (build the
    layout outside and pass it), not Dynamo's "function marked as skipped ... file an issue to PyTorch"."""
    q, k, v = projected_qkv()
    values = {"key_padding_mask": torch.arange(40) >= torch.tensor([[40], [29]]),
              "global_mask": torch.arange(40).expand(2, 40) == 0,
              "documents": (torch.arange(40) >= 17).long().expand(2, 40)}
    compiled, _ = inductor(lambda q, k, v, x: sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND, **{data: x}),
                           fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"key_padding_mask, global_mask and documents decide a "
                                                            r"Pattern's layout by their values") as error:
        compiled(q, k, v, values[data])
    assert ("build the layout outside the compiled function, layout = pattern.layout(n, heads=h, key_padding_mask=..., "
            "global_mask=..., documents=...), and pass the layout" in str(error.value))
    assert "marked as skipped" not in str(error.value)


def test_dynamic_lengths_build_the_layout_on_the_host():
    """A dynamic length has no value while tracing: the layout of each length is built when the graph runs."""
    compiled = torch.compile(lambda q, k, v: sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND, return_lse=True),
                             dynamic=True)
    for n in (20, 33):
        q, k, v = projected_qkv(n=n)
        for actual, expected in zip(compiled(q, k, v), sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND,
                                                                           return_lse=True)):
            torch.testing.assert_close(actual, expected, **TOLERANCE)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"lengths or the head count are dynamic .* compile with "
                                                            r"dynamic=False \(a graph per length\), or build the "
                                                            r"layout outside the compiled function"):
        torch.compile(lambda q, k, v: sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND), backend="eager",
                      dynamic=True, fullgraph=True)(*projected_qkv(n=20))


def test_a_dynamic_batch_keeps_the_graph_whole():
    """Without call-time data a Pattern's layout depends on the lengths, not on the batch: a batch size that is
    dynamic (a SymInt while tracing, which torch 2.11's Dynamo cannot hand to the layout build) keeps one graph
    under fullgraph=True."""
    compiled, graphs = inductor(lambda q, k, v: sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND, return_lse=True),
                                fullgraph=True)
    for batch in (2, 3):
        q, k, v = projected_qkv(batch=batch)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0)
        for actual, expected in zip(compiled(q, k, v), sa.sparse_attention(q, k, v, PATTERN, backend=BACKEND,
                                                                           return_lse=True)):
            torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1


def test_a_pattern_made_inside_the_compiled_function_is_one_graph_with_fullgraph():
    """A pattern made while Dynamo traces reaches the layout build as its value: one graph, forward and backward."""
    q, k, v = projected_qkv(n=20)

    def attend(q, k, v):
        return sa.sparse_attention(q, k, v, sa.Local(2) | sa.Causal(), backend=BACKEND, return_lse=True)

    compiled, graphs = inductor(attend, fullgraph=True)
    for actual, expected in zip(outputs_and_grads(compiled, q, k, v), outputs_and_grads(attend, q, k, v)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1


def test_an_equal_pattern_made_every_call_runs_one_graph():
    """A config-driven loop makes an equal pattern every step: one graph for all of them, past Dynamo's recompile
    limit (8) under fullgraph=True, where a pattern keyed by its identity compiled every step and failed on the 9th."""
    q, k, v = projected_qkv()
    compiled, graphs = inductor(attend_with, fullgraph=True, backend="eager")
    expected = attend_with(q, k, v, PATTERN)
    for _ in range(12):
        torch.testing.assert_close(compiled(q, k, v, sa.Local(4) | sa.Global(first=1)), expected)
    assert graphs.frame_count == 1


def test_each_pattern_value_compiles_once():
    """A different pattern compiles its own graph, and one seen before runs its graph again: Dynamo guards on the
    pattern's values (an int read from an argument, a symbol to Dynamo once its value changed, reaches the layout's
    key as its value)."""
    q, k, v = projected_qkv()
    compiled, graphs = inductor(attend_with, fullgraph=True, backend="eager")
    for window in (4, 5, 4, 5, 9, 4):
        pattern = sa.Local(window) | sa.Global(tokens=(window,))
        torch.testing.assert_close(compiled(q, k, v, pattern), attend_with(q, k, v, pattern))
    assert graphs.frame_count == 3


def test_a_dropped_pattern_is_freed_and_one_at_its_address_gets_its_own_layout():
    """The compiled function keeps no pattern alive, and a pattern that later takes a dropped one's address (which
    a guard on identity would take for it) runs its own layout, in a graph of its own."""
    q, k, v = projected_qkv()
    compiled, graphs = inductor(attend_with, fullgraph=True, backend="eager")
    pattern = sa.Local(4)
    compiled(q, k, v, pattern)
    address, alive = id(pattern), weakref.ref(pattern)
    del pattern
    gc.collect()
    assert alive() is None
    LAYOUT_CACHE.clear()
    others = [sa.Local(1)]                        # kept alive, so that each one takes a new address
    while id(others[-1]) != address and len(others) < 100_000:
        others.append(sa.Local(1))
    assert id(others[-1]) == address, "no pattern took the dropped one's address"
    torch.testing.assert_close(compiled(q, k, v, others[-1]), attend_with(q, k, v, sa.Local(1)))
    assert graphs.frame_count == 2


@pytest.mark.parametrize("kind", list(EXAMPLES))
def test_every_kind_made_anew_every_call_runs_one_graph(kind):
    """Every kind reaches the layout build as its value (a Blocks grid as bytes), under fullgraph=True."""
    q, k, v = projected_qkv(batch=1, q_heads=HEADS, n=N)
    compiled, graphs = inductor(attend_with, fullgraph=True, backend="eager")
    for _ in range(3):
        pattern = sa.Pattern.from_dict(EXAMPLES[kind].to_dict())                # equal, never the same object
        torch.testing.assert_close(compiled(q, k, v, pattern), attend_with(q, k, v, EXAMPLES[kind]))
    assert graphs.frame_count == 1


@pytest.mark.parametrize("fullgraph", [True, False])
def test_layer_forward_and_backward(fullgraph):
    """fullgraph=True: no masks, one graph; without it, key padding (built on the host: a graph break)."""
    torch.manual_seed(0)
    layer = SparseSelfAttention(32, 4, PATTERN, num_kv_heads=2, backend=BACKEND)
    x = torch.randn(2, 40, 32)                                                    # (B, N, E)
    padding = None if fullgraph else torch.arange(40) >= torch.tensor([[40], [29]])   # (B, N)
    compiled, graphs = inductor(layer, fullgraph=fullgraph)
    results = []
    for fn in (compiled, layer):
        layer.zero_grad()
        out = fn(x, key_padding_mask=padding)
        out.square().sum().backward()
        results.append([out] + [p.grad.clone() for p in layer.parameters()])
    for actual, expected in zip(*results):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1 or not fullgraph


def tiny_llama():
    """A one-layer Hugging Face Llama (GQA) on the sparse route with PATTERN, and token ids (2, 24)."""
    transformers = pytest.importorskip("transformers", reason='needs transformers: pip install ".[hf]"')
    from sparse_attn.integrations.transformers import register

    name = register(PATTERN, name="sparse_attn_test_compile", backend=BACKEND)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=100, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name)
    return model, torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))


def training_step(fn, model, ids) -> list:
    """The logits, the loss and every parameter's gradient of one step of ``fn`` (``model`` or its compiled form)."""
    model.zero_grad()
    out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    return [out.logits, out.loss] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # compiles a model
def test_hugging_face_llama_trains_compiled():
    """torch.compile(model) on the sparse route, one training step's loss and gradients against eager."""
    model, ids = tiny_llama()
    compiled, _ = inductor(model, fullgraph=False)
    for actual, expected in zip(training_step(compiled, model, ids), training_step(model, model, ids)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_triton_backend_with_a_layout_built_on_the_host():
    """The Triton ops under Inductor (in Triton's interpreter without a GPU). On CUDA the layout, built on the
    CPU, is moved while tracing; Inductor once died lowering the bool -> uint8 view of its in-graph copy. The
    sequence is shorter than a block, so the kernels get padded tiles."""
    pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = projected_qkv(batch=1, n=24, head_dim=16, device=device)
    layout = PATTERN.layout(24, heads=2, block_size=32)

    def attend(q, k, v):
        return sa.sparse_attention(q, k, v, layout, backend="triton", return_lse=True)

    compiled, graphs = inductor(attend, fullgraph=True)
    for actual, expected in zip(outputs_and_grads(compiled, q, k, v), outputs_and_grads(attend, q, k, v)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1


@pytest.mark.slow  # compiles a model
def test_hugging_face_llama_compiles_whole_with_fullgraph():
    """torch.compile(model, fullgraph=True) on the sparse route with no padding mask: one graph, forward and backward
    against eager (issue 23, item 9: packed_documents read the positions' values, a graph break). A packed batch
    (position_ids restart) raises when the graph runs, instead of running unpacked."""
    model, ids = tiny_llama()
    compiled, graphs = inductor(model, fullgraph=True)
    for actual, expected in zip(training_step(compiled, model, ids), training_step(model, model, ids)):
        torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert graphs.frame_count == 1
    packed = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)          # two documents per row
    with pytest.raises(RuntimeError, match=r"position_ids restart \(a packed batch\) in a model compiled with "
                                           r"torch.compile .* pass them, DataCollatorWithFlattening"):
        torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, position_ids=packed)  # Dynamo only
