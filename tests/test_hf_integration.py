"""HuggingFace transformers integration: attention function, mask function, registration.

Tiny randomly initialised models built from configs (no downloads), float32 on CPU.
"""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_dmattn.integrations as integ  # noqa: E402  (registers "dmattn")
from flash_dmattn.integrations import hf_transformers, hf_varlen  # noqa: E402
from flash_dmattn.integrations.flash_dynamic_mask_attention import (  # noqa: E402
    flash_dynamic_mask_attention_forward,
)
from flash_dmattn.testing import dropout_mask, dropout_rng  # noqa: E402

VOCAB = 128


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
class _Module(torch.nn.Module):
    def __init__(self, is_causal=True, training=False):
        super().__init__()
        self.is_causal = is_causal
        self.train(training)


def _eager(query, key, value, additive, scaling, softcap=None):
    """transformers-style eager attention with fully masked rows set to 0 (float64)."""
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, 1).double()
    v = value.repeat_interleave(g, 1).double()
    s = (query.double() @ k.transpose(-1, -2)) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if additive is not None:
        keep = torch.isfinite(additive) & (additive > torch.finfo(additive.dtype).min / 2)
        s = torch.where(keep, s + additive.double().nan_to_num(0.0, 0.0, 0.0), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def _qkv(b=2, h=4, hkv=2, lq=7, lk=7, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    return q, k, v


def _causal_additive(b, lq, lk, extra=0, dtype=torch.float32):
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk + extra)[None, :]
    allowed = (j <= i) & (j < lk)
    m = torch.zeros(b, 1, lq, lk + extra, dtype=dtype)
    return m.masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Counts library calls and records their masks/biases; proves dmattn actually ran."""
    calls = []

    def spy(real):
        def spy_get_kernel():
            fn = real()

            def run(**kw):
                calls.append(kw)
                return fn(**kw)

            return run

        return spy_get_kernel

    # Dense calls, decoding steps over a top-W selection (their calls carry key_index), and
    # padded calls run as packed sequences (on a GPU, where the varlen kernel pays: their
    # calls carry cu_seqlens_q).
    monkeypatch.setattr(hf_transformers, "_get_kernel", spy(hf_transformers._get_kernel))
    monkeypatch.setattr(hf_transformers, "_get_selected_kernel",
                        spy(hf_transformers._get_selected_kernel))
    monkeypatch.setattr(hf_varlen, "_get_varlen_kernel", spy(hf_varlen._get_varlen_kernel))
    return calls


@pytest.fixture
def mask_spy(monkeypatch):
    from transformers.masking_utils import AttentionMaskInterface

    seen = []
    real = AttentionMaskInterface._global_mapping["dmattn"]

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "dmattn", spy)
    return seen


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------
def test_registration():
    from transformers.masking_utils import AttentionMaskInterface

    assert transformers.AttentionInterface._global_mapping["dmattn"] is integ.dmattn_attention_forward
    assert AttentionMaskInterface._global_mapping["dmattn"] is integ.dmattn_mask
    assert integ.register() == "dmattn"  # idempotent
    with pytest.raises(ValueError, match="flash"):
        integ.register("flash_dmattn")


def test_mask_function_is_bool_or_none():
    kw = dict(batch_size=2, q_length=5, kv_length=5, device="cpu")
    import inspect

    if "q_length" not in inspect.signature(transformers.masking_utils.sdpa_mask).parameters:
        pytest.skip("transformers 4.x sdpa_mask signature (cache_position)")
    assert integ.dmattn_mask(**kw) is None  # plain causal: left to is_causal
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    m = integ.dmattn_mask(attention_mask=pad, **kw)
    assert m.dtype == torch.bool and m.shape == (2, 1, 5, 5)
    assert not m[0, 0, :, 0].any()
    assert torch.equal(m[1, 0], torch.ones(5, 5, dtype=torch.bool).tril())


# ---------------------------------------------------------------------------------------------
# the attention function on raw tensors
# ---------------------------------------------------------------------------------------------
def test_no_mask_causal_and_not_causal():
    q, k, v = _qkv()
    for causal in (True, False):
        out, w = integ.dmattn_attention_forward(_Module(is_causal=causal), q, k, v, None, scaling=0.3)
        assert w is None and out.shape == (2, 7, 4, 16)
        ref = _eager(q, k, v, _causal_additive(2, 7, 7) if causal else None, 0.3)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # kwargs override the module
    out, _ = integ.dmattn_attention_forward(_Module(is_causal=True), q, k, v, None, is_causal=False)
    ref = _eager(q, k, v, None, 1 / math.sqrt(16))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bool_and_additive_masks_longer_than_keys(kernel_spy):
    q, k, v = _qkv(lq=6, lk=9)
    add = _causal_additive(2, 6, 9, extra=5)  # static-cache style: 5 columns beyond the keys
    add[0, :, :, :2] = float("-inf")  # padding written as -inf
    ref = _eager(q, k, v, add[..., :9], 0.25)
    out_f, _ = integ.dmattn_attention_forward(_Module(), q, k, v, add, scaling=0.25)
    out_b, _ = integ.dmattn_attention_forward(_Module(), q, k, v, add > -1, scaling=0.25)
    for out in (out_f, out_b):
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # a 0 / sentinel additive mask is passed as a bool mask only, and never causal on top
    assert kernel_spy[0]["attn_bias"] is None and kernel_spy[0]["attn_mask"].dtype == torch.bool
    assert kernel_spy[0]["is_causal"] is False
    assert kernel_spy[0]["attn_mask"].shape[-1] == 9


def test_additive_mask_with_real_bias_gqa_softcap():
    q, k, v = _qkv(h=6, hkv=2, lq=5, lk=11, seed=1)
    add = _causal_additive(2, 5, 11)
    bias = torch.randn(2, 6, 5, 11)
    add = torch.where(add == 0, bias, add)  # Doge-style: real bias where kept, dtype-min elsewhere
    out, _ = integ.dmattn_attention_forward(_Module(), q, k, v, add, scaling=0.2, softcap=3.0)
    ref = _eager(q, k, v, add, 0.2, softcap=3.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_attention_bias_keyword_and_per_key_bias():
    q, k, v = _qkv(lq=4, lk=10, seed=2)
    bias = torch.randn(2, 2, 10)  # (B, Hkv, Lk): 1.2.x per-key form
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :3] = 0
    out, _ = integ.dmattn_attention_forward(_Module(), q, k, v, pad, attention_bias=bias)
    add = _causal_additive(2, 4, 10).masked_fill(~pad.bool()[:, None, None, :], float("-inf"))
    add = add + bias.repeat_interleave(2, 1)[:, :, None, :]
    ref = _eager(q, k, v, add, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the 1.2.x entry point: attention_bias is the sixth positional argument
    out2, _ = flash_dynamic_mask_attention_forward(_Module(), q, k, v, pad, bias)
    torch.testing.assert_close(out2, out)


def test_two_d_mask_shorter_than_keys_slices_static_slots():
    q, k, v = _qkv(lq=4, lk=12, seed=3)
    pad = torch.ones(2, 8, dtype=torch.bool)  # 8 seen tokens, 4 empty static-cache slots
    pad[0, 0] = False
    out, _ = integ.dmattn_attention_forward(_Module(), q, k, v, pad)
    add = _causal_additive(2, 4, 8).masked_fill(~pad[:, None, None, :], float("-inf"))
    ref = _eager(q, k[:, :, :8], v[:, :, :8], add, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_single_query_sees_every_key():
    q, k, v = _qkv(lq=1, lk=9, seed=4)
    out, _ = integ.dmattn_attention_forward(_Module(is_causal=True), q, k, v, None)
    torch.testing.assert_close(out.double(), _eager(q, k, v, None, 0.25), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero():
    q, k, v = _qkv(lq=3, lk=3)
    add = torch.full((2, 1, 3, 3), torch.finfo(torch.float32).min)
    out, _ = integ.dmattn_attention_forward(_Module(), q, k, v, add)
    assert torch.equal(out, torch.zeros_like(out))


def _eager_dropout(query, key, value, keep, p):
    """Causal eager attention (float64) with the probabilities times ``keep / (1 - p)``."""
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, 1)
    v = value.repeat_interleave(g, 1)
    s = (query @ k.transpose(-1, -2)) * query.shape[-1] ** -0.5
    lq, lk = s.shape[-2:]
    causal = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    probs = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    return (probs * keep / (1 - p) @ v).transpose(1, 2)


def test_dropout_in_training_is_the_kernels():
    # A training module's dropout runs in the library call: output and gradients equal eager
    # attention with the call's keep-mask; eval ignores it (as eager does); no module: applied.
    p = 0.3
    inputs = [t.double() for t in _qkv(lq=9, lk=9, seed=2)]
    for module in (_Module(training=True), None):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        torch.manual_seed(4)
        keep = dropout_mask(dropout_rng("cpu"), 2, 4, 9, 9, p)
        assert 0.5 < keep.double().mean() < 0.9
        torch.manual_seed(4)
        out, _ = integ.dmattn_attention_forward(module, *leaves, None, dropout=p)
        grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        got = (out.detach(), *torch.autograd.grad(out, leaves, grad))
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        ref = _eager_dropout(*leaves, keep, p)
        want = (ref.detach(), *torch.autograd.grad(ref, leaves, grad))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    plain, _ = integ.dmattn_attention_forward(_Module(training=False), *inputs, None)
    evaluated, _ = integ.dmattn_attention_forward(_Module(training=False), *inputs, None, dropout=p)
    assert torch.equal(evaluated, plain)
    with pytest.raises(ValueError, match="dropout"):
        integ.dmattn_attention_forward(_Module(training=True), *inputs, None, dropout=1.0)
    with pytest.raises(TypeError, match="dropout"):
        integ.dmattn_attention_forward(_Module(training=False), *inputs, None, dropout="0.1")


def test_llama_training_with_attention_dropout_matches_eager(monkeypatch):
    # A model trained with attention_dropout > 0 runs dmattn (it used to raise): its logits at
    # real positions and every parameter gradient equal eager attention's when eager's
    # F.dropout applies, layer by layer, the keep-masks the library calls drew.
    import flash_dmattn.inputs
    from transformers import LlamaConfig, LlamaForCausalLM

    p = 0.25
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=p,
    )
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="dmattn").train()
    ids, am = _batch(seq=13, pad=4)
    # The loss reads no logits of padded positions (eager gives their rows a uniform average,
    # dmattn zeros): padding is not scored, nor is the first real token (the label of the
    # last padded position).
    labels = ids.masked_fill(am == 0, -100)
    labels[0, 4] = -100
    rngs = []
    draw = flash_dmattn.inputs.draw_rng

    def recording_draw(device):
        rngs.append(draw(device))
        return rngs[-1]

    monkeypatch.setattr(flash_dmattn.inputs, "draw_rng", recording_draw)
    results = {}
    for impl in ("dmattn", "eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        torch.manual_seed(9)
        out = model(ids, attention_mask=am, labels=labels, dmattn_varlen="never")
        out.loss.backward()
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        results[impl] = (out.logits.detach(), grads)
        if impl == "dmattn":
            assert len(rngs) == cfg.num_hidden_layers
            masks = [dropout_mask(rng, 2, 4, 13, 13, p) for rng in rngs]
            real_dropout = torch.nn.functional.dropout

            def same_masks(x, p=0.5, training=True, inplace=False):
                if not training or p == 0.0:
                    return real_dropout(x, p, training, inplace)
                return x * masks.pop(0) / (1 - p)

            monkeypatch.setattr(torch.nn.functional, "dropout", same_masks)
    assert not masks  # eager used every mask
    (logits, grads), (ref_logits, ref_grads) = results["dmattn"], results["eager"]
    keep = am.bool()
    torch.testing.assert_close(logits[keep], ref_logits[keep], atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-5, rtol=1e-4, msg=name)


def test_legacy_window_forward_passes_dropout_in_training_only(kernel_spy):
    q, k, v = _qkv(lq=9, lk=9, seed=3)
    bias = torch.randn(2, 2, 9)
    for training, want in ((True, 0.2), (False, 0.0)):
        flash_dynamic_mask_attention_forward(_Module(training=training), q, k, v, None, bias,
                                             window_size=4, dropout=0.2)
        assert kernel_spy[-1]["dropout_p"] == want


def test_bad_inputs_raise_typed_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="2-D attention_mask"):
        integ.dmattn_attention_forward(_Module(), q, k, v, torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError):
        integ.dmattn_attention_forward(_Module(), q, k, v, "mask")
    with pytest.raises(ValueError, match="attention sinks"):
        integ.dmattn_attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4))


def test_legacy_window_size_topk():
    q, k, v = _qkv(lq=6, lk=6, seed=5)
    bias = torch.randn(2, 2, 1, 6)
    out, _ = flash_dynamic_mask_attention_forward(_Module(), q, k, v, None, bias, window_size=2)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    score = bias.expand(2, 2, 6, 6).masked_fill(j > i, float("-inf"))
    top = score.topk(2, dim=-1).indices
    keep = torch.zeros(2, 2, 6, 6, dtype=torch.bool).scatter(-1, top, True) & (j <= i)
    add = torch.where(keep, bias.expand(2, 2, 6, 6), float("-inf")).repeat_interleave(2, 1)
    ref = _eager(q, k, v, add, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _legacy_both_ways(monkeypatch, kernel_spy, q, k, v, mask, bias, window, module=None):
    """The 1.2.x call with its interval selection and with the dense one forced."""
    from flash_dmattn.integrations import flash_dynamic_mask_attention as legacy

    module = _Module() if module is None else module
    out, _ = flash_dynamic_mask_attention_forward(module, q, k, v, mask, bias, window_size=window)
    used = kernel_spy[-1]["attn_mask"]
    with monkeypatch.context() as mp:
        mp.setattr(legacy, "_interval_selection", lambda *a: None)
        dense, _ = flash_dynamic_mask_attention_forward(module, q, k, v, mask, bias, window_size=window)
    assert isinstance(kernel_spy[-1]["attn_mask"], torch.Tensor)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)
    return out, used


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("lq", [9, 4, 1])
@pytest.mark.parametrize("tied", [False, True])
def test_legacy_window_topk_builds_key_intervals(monkeypatch, kernel_spy, is_causal, lq, tied):
    from flash_dmattn.masks import KeyIntervals

    q, k, v = _qkv(lq=lq, lk=9, seed=6)
    g = torch.Generator().manual_seed(lq)
    bias = torch.randint(0, 3, (2, 2, 9), generator=g).float() if tied else torch.randn(2, 2, 9, generator=g)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :2] = 0
    pad[1, 5] = 0
    for mask in (None, pad):
        _, used = _legacy_both_ways(monkeypatch, kernel_spy, q, k, v, mask, bias, 3, _Module(is_causal))
        # (with no mask, a causal prefill of an empty static cache attends to the first Lq keys)
        keys = kernel_spy[-2]["key"].shape[1]
        assert isinstance(used, KeyIntervals) and used.shape == (2, 2, keys)


def test_legacy_window_topk_reads_the_padding_record(monkeypatch, kernel_spy):
    # A (B, 1, L, L) bool mask that dmattn_mask built as "causal + padding" carries a record;
    # the selection then comes from the record's (B, L) padding as key intervals. The same
    # mask without a record (or edited in place) keeps the dense path.
    from flash_dmattn.integrations import hf_varlen
    from flash_dmattn.masks import KeyIntervals

    q, k, v = _qkv(lq=10, lk=10, seed=7)
    bias = torch.randn(2, 2, 1, 10, generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :3] = False
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    mask = ((j <= i) & pad[:, None, None, :]).reshape(2, 1, 10, 10)
    record = hf_varlen.PaddingRecord(padding=pad, version=mask._version, causal=True, q_offset=0)
    hf_varlen.attach_record(mask, record)
    out, used = _legacy_both_ways(monkeypatch, kernel_spy, q, k, v, mask, bias, 4)
    assert isinstance(used, KeyIntervals) and kernel_spy[-2]["is_causal"]
    plain = mask.clone()  # no record
    out2, used2 = _legacy_both_ways(monkeypatch, kernel_spy, q, k, v, plain, bias, 4)
    assert isinstance(used2, torch.Tensor)
    torch.testing.assert_close(out, out2, atol=1e-6, rtol=1e-6)
    mask[0, 0, 0, 0] = False  # edited in place: the record no longer describes the mask
    _, used3 = _legacy_both_ways(monkeypatch, kernel_spy, q, k, v, mask, bias, 4)
    assert isinstance(used3, torch.Tensor)


def test_legacy_window_topk_dense_where_intervals_do_not_apply(kernel_spy):
    # A bias with a query dim, or a 4-D user mask: the dense selection.
    q, k, v = _qkv(lq=6, lk=6, seed=8)
    flash_dynamic_mask_attention_forward(_Module(), q, k, v, None, torch.randn(2, 2, 6, 6), window_size=2)
    assert isinstance(kernel_spy[-1]["attn_mask"], torch.Tensor)
    user = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    flash_dynamic_mask_attention_forward(_Module(), q, k, v, user, torch.randn(2, 2, 6), window_size=2)
    assert isinstance(kernel_spy[-1]["attn_mask"], torch.Tensor)


# ---------------------------------------------------------------------------------------------
# whole models
# ---------------------------------------------------------------------------------------------
def _batch(seq=20, pad=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, seq), generator=g)
    am = torch.ones_like(ids)
    am[0, :pad] = 0  # left padding
    ids[0, :pad] = 0
    return ids, am


def _compare_with_eager(model, kernel_spy, mask_spy, seq=20):
    ids, am = _batch(seq)
    keep = am.bool()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=am).logits
        ref_gen = model.generate(
            ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
        ref_nopad = model(ids[1:]).logits
        model.set_attn_implementation("dmattn")
        assert model.config._attn_implementation == "dmattn"
        n0 = len(kernel_spy)
        out = model(ids, attention_mask=am).logits
        assert len(kernel_spy) - n0 == model.config.num_hidden_layers
        gen = model.generate(
            ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
        out_nopad = model(ids[1:]).logits
    # Padded query rows differ by design (eager averages over all keys, dmattn gives 0);
    # they are never attended to, so every real position must agree.
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_nopad, ref_nopad, atol=1e-5, rtol=1e-5)
    assert torch.equal(gen, ref_gen)
    # prefill + 4 decode steps per layer went through the library, with the padding mask
    assert len(kernel_spy) - n0 >= model.config.num_hidden_layers * (1 + 5 + 1)
    assert any(m is not None and m.dtype == torch.bool for m in mask_spy)
    assert any(c["query"].shape[1] == 1 for c in kernel_spy)  # decode steps with a KV cache
    return kernel_spy[n0:]


def test_llama_matches_eager(kernel_spy, mask_spy):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="dmattn").eval()
    assert model.config._attn_implementation == "dmattn"
    calls = _compare_with_eager(model, kernel_spy, mask_spy)
    # GQA reached the library without repeat_kv
    assert all(c["key"].shape[2] == 2 and c["query"].shape[2] == 4 for c in calls)
    # an unpadded prefill needs no mask at all: is_causal does the work
    assert any(c["attn_mask"] is None and c["is_causal"] for c in calls)


def test_doge_matches_eager(kernel_spy, mask_spy):
    doge = pytest.importorskip("transformers.models.doge", reason="transformers has no Doge")
    cfg = doge.DogeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        keep_window_size=8,  # < sequence length: Doge's top-k dynamic mask is active
    )
    torch.manual_seed(0)
    model = doge.DogeForCausalLM._from_config(cfg, attn_implementation="dmattn").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            # A is zero-initialised, which makes every dynamic-mask bias exactly 1 (all ties);
            # random values give a real, distinct bias per key.
            layer.self_attn.A.normal_(0.0, 1.0)
    calls = _compare_with_eager(model, kernel_spy, mask_spy, seq=20)
    prefill = [c for c in calls if c["query"].shape[1] == 20]
    assert prefill and all(c["attn_bias"] is not None for c in prefill)
    # the top-k keeps at most keep_window_size keys per query
    assert all(int(c["attn_mask"].sum(-1).max()) <= 8 for c in prefill)
    # decoding steps attend to the 8 kept keys of each kv head by index, reading the mask
    # values as bias: no bool mask over the cache
    steps = [c for c in calls if c["query"].shape[1] == 1]
    assert steps and all(tuple(c["key_index"].shape) == (2, 2, 8) for c in steps)
    assert all(c["attn_bias"].shape[1] == 2 for c in steps)


def test_doge_generate_without_padding_matches_eager(kernel_spy):
    # Greedy tokens equal eager's; every decoding step took the top-W path.
    doge = pytest.importorskip("transformers.models.doge", reason="transformers has no Doge")
    cfg = doge.DogeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        keep_window_size=8,
    )
    torch.manual_seed(1)
    model = doge.DogeForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        model.set_attn_implementation("dmattn")
        gen = model.generate(ids, **kw)
    assert torch.equal(gen, ref)
    steps = [c for c in kernel_spy if c["query"].shape[1] == 1]
    assert len(steps) == 3 * 2 and all(c["key_index"].shape[-1] == 8 for c in steps)


def test_mask_function_lets_doge_decoding_steps_skip_the_causal_mask():
    # Doge folds the mask into its dynamic mask, which drops the meaning of None (causal) for
    # several queries: those always get the materialised mask. A single query has no
    # causality: it gets sdpa's answer (None where sdpa may skip, i.e. without padding).
    doge = pytest.importorskip("transformers.models.doge", reason="transformers has no Doge")
    from transformers.masking_utils import causal_mask_function

    cfg = doge.DogeConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=1)
    common = dict(batch_size=2, kv_length=13, kv_offset=0, mask_function=causal_mask_function,
                  allow_is_causal_skip=True, config=cfg, device="cpu")
    prefill = hf_transformers.dmattn_mask(q_length=13, q_offset=0, attention_mask=None, **common)
    assert prefill is not None and prefill.shape == (2, 1, 13, 13)
    assert hf_transformers.dmattn_mask(q_length=1, q_offset=12, attention_mask=None, **common) is None
    padded = torch.ones(2, 13, dtype=torch.bool)
    padded[0, :3] = False
    step = hf_transformers.dmattn_mask(q_length=1, q_offset=12, attention_mask=padded, **common)
    assert torch.equal(step[:, 0, 0], padded)


class _DogeLayer(_Module):
    """What the integration reads of a Doge attention layer."""

    def __init__(self, window):
        super().__init__()
        self.keep_window_size = window
        self.config = type("Cfg", (), {"model_type": "doge"})()


def _doge_step_mask(b, hkv, g, lk, window, dtype, seed=0):
    """A Doge decoding step's additive mask: per kv head the top-``window`` of a random bias
    (dtype-min elsewhere; the last keys of batch 0 are padding), repeated over each group."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.rand(b, hkv, 1, lk, generator=gen).to(dtype)
    lo = torch.finfo(dtype).min
    bias[0, :, :, -3:] = lo
    top = torch.topk(bias, window, dim=-1).indices
    m = torch.full_like(bias, lo).scatter(-1, top, bias.gather(-1, top))
    return m.repeat_interleave(g, 1)


@pytest.mark.parametrize("backend", [None, "triton"])
def test_doge_decode_step_attends_to_the_kept_keys_by_index(kernel_spy, monkeypatch, backend):
    # One step through the attention function: the kept keys by index (the triton kernel when
    # forced under the interpreter, else the gathered call), equal to eager on the mask.
    if backend == "triton":
        from interpreter_only import interpreter_skip_reason

        reason = interpreter_skip_reason()
        if reason is not None:
            pytest.skip(str(reason))
        monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    q, k, v = _qkv(b=2, h=4, hkv=2, lq=1, lk=30, d=16)
    # A mask in another float dtype than the query (fp16 here): masked where its own dtype's
    # minimum is, as the dense path reads it.
    for dtype in (torch.float32, torch.float16):
        add = _doge_step_mask(2, 2, 2, 30, 6, dtype)
        out, _ = hf_transformers.dmattn_attention_forward(_DogeLayer(6), q, k, v, add,
                                                          scaling=0.25)
        torch.testing.assert_close(out.double(), _eager(q, k, v, add, 0.25), atol=1e-5,
                                   rtol=1e-5)
        call = kernel_spy[-1]
        assert tuple(call["key_index"].shape) == (2, 2, 6) and call["attn_bias"].shape[1] == 2
    if backend is not None:
        return
    # Not a Doge step: the dense path (window not exceeded, another model, two queries)
    for module, lk, lq in ((_DogeLayer(30), 30, 1), (_Module(), 30, 1), (_DogeLayer(6), 30, 2)):
        q2, k2, v2 = _qkv(b=2, h=4, hkv=2, lq=lq, lk=lk, d=16)
        add2 = _doge_step_mask(2, 2, 2, lk, min(6, lk), torch.float32).expand(2, 4, lq, lk)
        out2, _ = hf_transformers.dmattn_attention_forward(module, q2, k2, v2, add2, scaling=0.25)
        torch.testing.assert_close(out2.double(), _eager(q2, k2, v2, add2, 0.25),
                                   atol=1e-5, rtol=1e-5)
        assert "key_index" not in kernel_spy[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "doge"])
def test_gpu_bf16_matches_eager_on_fast_backend(arch, kernel_spy):
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        model = LlamaForCausalLM._from_config(LlamaConfig(**common), attn_implementation="dmattn")
    else:
        doge = pytest.importorskip("transformers.models.doge", reason="transformers has no Doge")
        model = doge.DogeForCausalLM._from_config(
            doge.DogeConfig(keep_window_size=64, **common), attn_implementation="dmattn"
        )
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_(0.0, 1.0)
    model = model.to("cuda", torch.bfloat16).eval()
    ids, am = _batch(seq=160, pad=17)
    ids, am = ids.cuda(), am.cuda()
    keep = am.bool()
    with torch.no_grad(), warnings.catch_warnings():
        # a fallback to torch-reference on CUDA warns: make it fail the test
        warnings.simplefilter("error", RuntimeWarning)
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=am).logits.float()
        model.set_attn_implementation("dmattn")
        n0 = len(kernel_spy)
        out = model(ids, attention_mask=am).logits.float()
        model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(kernel_spy) - n0 >= model.config.num_hidden_layers * 4
    # bf16 end to end (weights, activations, both attention paths): relative error ~1e-2
    err = (out[keep] - ref[keep]).norm() / ref[keep].norm()
    assert err < 3e-2, err.item()
