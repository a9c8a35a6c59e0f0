"""BlockLayout's fields are declared and typed: the tensors live in ``layout.index``, the old names read it, and
the checks of a hand-built layout (``sparse_attn.layout_checks``) return values instead of changing a layout."""
import doctest
import io
import pickle
import typing

import pytest
import torch

import sparse_attn as sa
from sparse_attn import layout_checks
from sparse_attn.layout import BlockLayout, CallData, KernelIndex


def _layout() -> BlockLayout:
    return (sa.Local(5) | sa.Global(first=1)).layout(37, heads=2, block_size=8, causal=True)


def test_the_fields_are_declared_with_their_types():
    hints = typing.get_type_hints(BlockLayout)
    assert hints["index"] is KernelIndex
    assert {name: hints[name] for name in ("n_q", "n_k", "heads", "block_size")} == dict.fromkeys(
        ("n_q", "n_k", "heads", "block_size"), int)
    assert hints["causal"] is bool and hints["call_data"] == (CallData | None)


def test_the_tensors_live_in_the_index_and_the_old_names_read_it():
    layout = _layout()
    assert type(layout.index) is KernelIndex
    assert not [name for name, value in vars(layout).items() if isinstance(value, torch.Tensor)]
    for name, tensor in layout.index._asdict().items():
        assert getattr(layout, name) is tensor
        with pytest.raises(AttributeError, match=f"property '{name}' of 'BlockLayout' object has no setter"):
            setattr(layout, name, tensor.clone())


def test_a_hand_built_layout_holds_the_checked_tensors_in_the_abi_order():
    built = _layout()
    tensors = {name: tensor.clone() for name, tensor in reversed(built.index._asdict().items())}
    tensors["part_idx"] = tensors["part_idx"].repeat_interleave(2)[::2]                 # a non-contiguous view
    layout = sa.BlockLayout(pattern=None, n_q=37, n_k=37, heads=2, block_size=8, causal=True, **tensors)
    assert all(torch.equal(a, b) for a, b in zip(layout.index, built.index))
    assert layout.part_idx.is_contiguous() and not tensors["part_idx"].is_contiguous()
    assert layout.full_ptr is tensors["full_ptr"]                              # already contiguous: not copied


def test_checked_tensors_returns_contiguous_tensors_and_leaves_its_argument_alone():
    tensors = _layout().index._asdict()
    tensors["masks"] = tensors["masks"].transpose(1, 2).contiguous().transpose(1, 2)   # same values, strided
    given = dict(tensors)
    checked = layout_checks.checked_tensors(tensors, n_q=37, n_k=37, heads=2, block_size=8)
    assert tensors == given and not tensors["masks"].is_contiguous()
    assert list(checked) == list(KernelIndex._fields) and checked["masks"].is_contiguous()
    assert torch.equal(checked["masks"], tensors["masks"])


def test_the_tensor_names_are_checked_against_the_given_fields():
    layout_checks.check_tensor_names(dict.fromkeys(reversed(KernelIndex._fields)), KernelIndex._fields)
    with pytest.raises(TypeError, match=r"missing \['masks'\], unexpected \['mask'\]"):
        layout_checks.check_tensor_names({**dict.fromkeys(KernelIndex._fields[:5]), "mask": None,
                                          **dict.fromkeys(KernelIndex._fields[6:])}, KernelIndex._fields)


@pytest.mark.parametrize("save, load", [(pickle.dumps, pickle.loads),
                                        (lambda layout: _saved(layout), lambda data: torch.load(
                                            io.BytesIO(data), weights_only=False))], ids=["pickle", "torch.save"])
def test_a_layout_survives_pickling(save, load):
    layout = _layout()
    copy = load(save(layout))
    assert repr(copy) == repr(layout) and str(copy) == str(layout) and copy.call_data == layout.call_data
    assert type(copy.index) is KernelIndex and all(torch.equal(a, b) for a, b in zip(copy.index, layout.index))
    assert copy.to("meta") is copy.to("meta") and copy.to("cpu") is copy


def _saved(layout: BlockLayout) -> bytes:
    buffer = io.BytesIO()
    torch.save(layout, buffer)
    return buffer.getvalue()


def test_docstring_examples():
    result = doctest.testmod(layout_checks, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
