"""Tests for flash_dmattn.utils.padding (varlen pack/unpack helpers)."""
import pytest
import torch

from flash_dmattn.utils.padding import cu_seqlens_from_lengths, pad_input, unpad_input


def _masks():
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    left = right.flip(-1)
    holes = torch.tensor([[1, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    return {"right": right, "left": left, "holes": holes}


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_unpad_metadata(kind):
    mask = _masks()[kind]
    hidden = torch.arange(3 * 5, dtype=torch.float32).view(3, 5, 1).expand(3, 5, 2)
    unpadded, indices, cu, max_len, used = unpad_input(hidden, mask)
    lengths = mask.sum(-1).tolist()
    assert used.dtype == torch.int32 and used.tolist() == lengths
    assert cu.dtype == torch.int32 and cu.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert max_len == max(lengths) and isinstance(max_len, int)
    expected_idx = [b * 5 + t for b in range(3) for t in range(5) if mask[b, t]]
    assert indices.tolist() == expected_idx
    assert unpadded.shape == (sum(lengths), 2)
    # Row b's tokens sit in cu[b]:cu[b+1], in position order.
    for b in range(3):
        seg = unpadded[cu[b]:cu[b + 1], 0].tolist()
        assert seg == [float(b * 5 + t) for t in range(5) if mask[b, t]]


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_round_trip(kind):
    mask = _masks()[kind]
    hidden = torch.randn(3, 5, 2, 4)
    unpadded, indices, *_ = unpad_input(hidden, mask)
    padded = pad_input(unpadded, indices, 3, 5)
    assert padded.shape == hidden.shape
    assert torch.equal(padded, hidden * mask.view(3, 5, 1, 1))


def test_integer_mask_accepted():
    mask = _masks()["left"]
    hidden = torch.randn(3, 5, 7)
    a = unpad_input(hidden, mask)
    b = unpad_input(hidden, mask.to(torch.int64))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_gradients_flow_through_unpad_and_pad():
    mask = _masks()["holes"]
    hidden = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    unpadded, indices, *_ = unpad_input(hidden, mask)
    weights = torch.randn(3, 5, 4, dtype=torch.float64)
    (pad_input(unpadded * 2, indices, 3, 5) * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, 2 * weights * mask.unsqueeze(-1))

    assert torch.autograd.gradcheck(lambda h: unpad_input(h, mask)[0], (hidden.detach().requires_grad_(),))
    packed = torch.randn(int(mask.sum()), 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: pad_input(x, indices, 3, 5), (packed,))


def test_empty_rows_and_all_padding():
    hidden = torch.randn(2, 3, 4)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    unpadded, indices, cu, max_len, used = unpad_input(hidden, mask)
    assert unpadded.shape == (0, 4) and indices.numel() == 0
    assert cu.tolist() == [0, 0, 0] and max_len == 0 and used.tolist() == [0, 0]
    assert torch.equal(pad_input(unpadded, indices, 2, 3), torch.zeros(2, 3, 4))


def test_cu_seqlens_from_lengths():
    out = cu_seqlens_from_lengths(torch.tensor([3, 0, 5, 1]))
    assert out.dtype == torch.int32 and out.tolist() == [0, 3, 3, 8, 9]
    assert cu_seqlens_from_lengths([2, 2]).tolist() == [0, 2, 4]
    assert cu_seqlens_from_lengths(torch.tensor([], dtype=torch.int32)).tolist() == [0]
    with pytest.raises(ValueError):
        cu_seqlens_from_lengths(torch.tensor([1, -1]))
    with pytest.raises(ValueError):
        cu_seqlens_from_lengths(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError):
        cu_seqlens_from_lengths(torch.tensor([2**31 - 1, 1]))
    with pytest.raises(TypeError):
        cu_seqlens_from_lengths(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError):
        cu_seqlens_from_lengths([1.5])


def test_validation_errors():
    hidden = torch.randn(2, 3, 4)
    with pytest.raises(TypeError):
        unpad_input(hidden, torch.ones(2, 3))  # float mask
    with pytest.raises(ValueError):
        unpad_input(hidden, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError):
        unpad_input(torch.randn(3), torch.ones(3, dtype=torch.bool))
    unpadded, indices, *_ = unpad_input(hidden, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError):
        pad_input(unpadded, indices[:-1], 2, 3)
    with pytest.raises(TypeError):
        pad_input(unpadded, indices.float(), 2, 3)
    with pytest.raises(ValueError):
        pad_input(unpadded, indices, -1, 3)
    with pytest.raises(TypeError):
        pad_input(unpadded, indices, 2, 3.0)
