"""A small model that calls flash_dmattn_func compiles with torch.compile and matches eager."""
import torch

from flash_dmattn import flash_dmattn_func


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.bias = torch.nn.Linear(dim, kv_heads)  # a learned per-key bias
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, l, _ = x.shape
        q = self.q(x).view(b, l, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, l, 2, self.kv_heads, self.head_dim).unbind(2)
        bias = self.bias(x).transpose(1, 2).unsqueeze(2)  # (B, Hkv, 1, L)
        out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
        return self.o(out.reshape(b, l, -1))


def test_compiled_model_matches_eager():
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 24, 32)
    mask = torch.rand(2, 1, 1, 24) > 0.2
    eager_out = model(x, mask)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), list(model.parameters()))
    # fullgraph=True: dispatch, validation and the attention itself trace without graph breaks
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x, mask)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inductor_compile_matches_eager():
    torch.manual_seed(1)
    model = TinyAttention()
    x = torch.randn(1, 16, 32)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=1e-5, rtol=1e-5)
