"""float32 Linear layers through oneDNN (models/cpu_linear.py): the same numbers as F.linear up to float32 rounding,
autograd kept, only plain nn.Linear turned, and a model attached on CPU served with the choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import cpu_linear
from models.adapters.bert import BertAdapter
from models.cpu_linear import OneDNNLinear, route_linear, set_cpu_linear
from tests.float32 import assert_close_f32, attention_terms

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def mode():
    """Set the process's choice for one test and put the previous one back."""
    previous = cpu_linear._mode
    yield set_cpu_linear
    set_cpu_linear(previous)


def onednn_copy(linear: nn.Linear) -> nn.Linear:
    turned = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    turned.load_state_dict(linear.state_dict())
    turned.__class__ = OneDNNLinear
    return turned


@pytest.mark.parametrize("shape", [(128, 384), (2, 37, 384), (3, 4, 5, 384), (1, 384)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_same_products_up_to_float32_rounding(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(384, 1536, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected, actual = F.linear(x, linear.weight, linear.bias), onednn_copy(linear)(x)
    assert actual.shape == expected.shape
    # each output sums 384 products of size |x|·|w| (and the bias)
    assert_close_f32(actual, expected, 384, scale=float(x.abs().max() * linear.weight.detach().abs().max()) * 4)
    assert not torch.equal(actual, torch.zeros_like(actual))


def test_a_non_contiguous_input_and_an_empty_one():
    torch.manual_seed(1)
    linear = onednn_copy(nn.Linear(64, 32))
    x = torch.randn(64, 10).t()  # (10, 64), strided
    with torch.inference_mode():
        assert_close_f32(linear(x), F.linear(x.contiguous(), linear.weight, linear.bias), 64, scale=64.0)
        assert linear(torch.randn(0, 64)).shape == (0, 32)


def test_gradients_flow_as_through_f_linear():
    """oneDNN's op has no derivative: with autograd on, the layer must take F.linear, or the gradients are lost."""
    torch.manual_seed(2)
    plain = nn.Linear(16, 8)
    turned = onednn_copy(plain)
    x = torch.randn(5, 16, requires_grad=True)
    turned(x).square().sum().backward()
    from_turned = x.grad.clone()
    x.grad = None
    plain(x).square().sum().backward()
    assert torch.allclose(from_turned, x.grad)
    assert turned.weight.grad is not None and torch.allclose(turned.weight.grad, plain.weight.grad)


def test_route_turns_plain_linear_layers_only(mode):
    class OwnLinear(nn.Linear):  # a subclass (a quantized layer, say) keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), OwnLinear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mode("onednn")
    assert route_linear(model) == 2
    assert [type(m) for m in (model[0], model[2], model[3][0])] == [OneDNNLinear, OwnLinear, OneDNNLinear]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_blas_turns_none_and_a_bad_choice_is_refused(mode):
    model = nn.Sequential(nn.Linear(8, 8))
    mode("blas")
    assert route_linear(model) == 0 and type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="cpu_linear"):
        set_cpu_linear("mkl")


def test_auto_follows_the_measured_ratio(mode, monkeypatch):
    mode("auto")
    monkeypatch.setattr(cpu_linear, "measured_ratio", lambda: 0.95)
    assert not cpu_linear.use_onednn()
    monkeypatch.setattr(cpu_linear, "measured_ratio", lambda: 0.5)
    assert cpu_linear.use_onednn()


def test_a_model_attached_on_cpu_gives_the_same_attention_either_way(mode, tiny_bert):
    """The adapter's own forward (hooks, recorded softmax) over oneDNN's products against MKL's."""
    mode("onednn")
    fast = BertAdapter("tiny", str(tiny_bert), max_tokens=64, device="cpu")
    mode("blas")
    plain = BertAdapter("tiny", str(tiny_bert), max_tokens=64, device="cpu")
    assert any(type(m) is OneDNNLinear for m in fast.model.modules())
    assert not any(type(m) is OneDNNLinear for m in plain.model.modules())
    text = "the cat sat on the mat because it was tired ."
    a, b = fast.run(fast.encode(text)), plain.run(plain.encode(text))
    terms = attention_terms(plain.model.config, a.attention.shape[-1]) + plain.model.config.hidden_size
    assert_close_f32(a.attention, b.attention, terms, scale=1.0)
    assert_close_f32(a.hidden_states, b.hidden_states, terms * plain.model.config.num_hidden_layers)
