"""transformers integration: "causal + key padding" masks routed through the packed (varlen) path.

Tiny randomly initialised models built from configs (no downloads), float32 on CPU. The
routing is forced with ``FLASH_DMATTN_HF_VARLEN`` / ``set_varlen_mode`` / the ``dmattn_varlen``
keyword, because ``auto`` never packs on CPU (only torch-reference takes packed calls there).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_dmattn.integrations as integ  # noqa: E402  (registers "dmattn")
from flash_dmattn.integrations import hf_transformers, hf_varlen  # noqa: E402
from flash_dmattn.utils.padding import gather_tokens, unpad_indices, unpad_input  # noqa: E402

VOCAB = 128
SEQ = 12


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _clean_mode(monkeypatch):
    monkeypatch.delenv(hf_varlen.ENV_VAR, raising=False)
    hf_varlen.set_varlen_mode(None)
    yield
    hf_varlen.set_varlen_mode(None)


def _spy_on(monkeypatch, module, getter):
    """Wrap the kernel ``module.<getter>()`` returns so every call's kwargs are recorded."""
    calls = []
    real = getattr(module, getter)

    def spy_get():
        fn = real()

        def run(**kw):
            calls.append(kw)
            return fn(**kw)

        return run

    monkeypatch.setattr(module, getter, spy_get)
    return calls


@pytest.fixture
def varlen_spy(monkeypatch):
    """Records every packed call the integration makes (proves the route was taken)."""
    return _spy_on(monkeypatch, hf_varlen, "_get_varlen_kernel")


@pytest.fixture
def dense_spy(monkeypatch):
    """Records every dense library call."""
    return _spy_on(monkeypatch, hf_transformers, "_get_kernel")


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.eval()


def _llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="dmattn").eval()


def _padding(side, lengths=(7, 1, SEQ, 4), seq=SEQ):
    """(B, seq) long padding mask: real lengths per row, padding on ``side``."""
    am = torch.zeros(len(lengths), seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            am[b, seq - n:] = 1
        else:
            am[b, :n] = 1
    return am


def _batch(side, seed=0):
    g = torch.Generator().manual_seed(seed)
    am = _padding(side)  # includes a length-1 row and an unpadded row
    ids = torch.randint(3, VOCAB, am.shape, generator=g).masked_fill(am == 0, 0)
    return ids, am


def _mask(attention_mask, q_length, kv_length, q_offset=0, causal=True):
    """dmattn's registered mask function, called as transformers calls it."""
    from transformers import masking_utils

    fn = masking_utils.causal_mask_function if causal else masking_utils.bidirectional_mask_function
    return integ.dmattn_mask(
        batch_size=attention_mask.shape[0], q_length=q_length, kv_length=kv_length,
        q_offset=q_offset, kv_offset=0, mask_function=fn, attention_mask=attention_mask.bool(),
        allow_is_causal_skip=causal, device="cpu",
    )


def _qkv(b, lq, lk, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, hkv, lk, d, generator=g),
            torch.randn(b, hkv, lk, d, generator=g))


def _attend(mode, q, k, v, mask, **kw):
    out, _ = integ.dmattn_attention_forward(_Module(), q, k, v, mask, dmattn_varlen=mode, **kw)
    return out


# ---------------------------------------------------------------------------------------------
# the attention function on raw tensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_attention_rows_match_dense_and_padded_rows_are_zero(side, varlen_spy):
    am = _padding(side)
    q, k, v = _qkv(4, SEQ, SEQ)
    mask = _mask(am, SEQ, SEQ)
    dense = _attend("never", q, k, v, mask, scaling=0.3, softcap=5.0)
    assert not varlen_spy
    packed = _attend("always", q, k, v, mask, scaling=0.3, softcap=5.0)
    assert len(varlen_spy) == 1
    call = varlen_spy[0]
    assert call.get("attn_mask") is None and call.get("attn_bias") is None  # no mask to read
    assert call["query"].shape == (int(am.sum()), 4, 16) and call["key"].shape[1] == 2  # GQA kept
    assert call["cu_seqlens_q"].tolist() == [0, 7, 8, 20, 24] and call["is_causal"] is True
    keep = am.bool()
    torch.testing.assert_close(packed[keep], dense[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(packed[~keep], torch.zeros_like(packed[~keep]))
    if side == "left":
        # left-padded query rows see no key: the dense path returns exactly 0 there too
        torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)


def test_bidirectional_mask_keeps_every_query_row(varlen_spy):
    am = _padding("right")
    q, k, v = _qkv(4, SEQ, SEQ, seed=1)
    mask = _mask(am, SEQ, SEQ, causal=False)
    dense = _attend("never", q, k, v, mask)
    packed = _attend("always", q, k, v, mask)
    assert varlen_spy[0]["is_causal"] is False and varlen_spy[0]["query"].shape[0] == 4 * SEQ
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)  # padded rows included


def test_prefill_on_top_of_a_cache(varlen_spy):
    # 5 cached tokens + 4 new ones (chunked prefill): queries are the last 4 key positions
    am = _padding("left", lengths=(9, 3, 6), seq=9)
    q, k, v = _qkv(3, 4, 9, seed=2)
    mask = _mask(am, 4, 9, q_offset=5)
    dense = _attend("never", q, k, v, mask)
    packed = _attend("always", q, k, v, mask)
    assert len(varlen_spy) == 1
    keep = am[:, 5:].bool()
    torch.testing.assert_close(packed[keep], dense[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)  # left padding: all rows


def test_padding_mask_shorter_than_keys(varlen_spy):
    # transformers pads a short 2-D mask with False (padding) up to kv_length
    am = _padding("right", lengths=(10, 4), seq=10)
    q, k, v = _qkv(2, SEQ, SEQ, seed=8)
    mask = _mask(am, SEQ, SEQ)
    dense = _attend("never", q, k, v, mask)
    packed = _attend("always", q, k, v, mask)
    assert varlen_spy[0]["cu_seqlens_k"].tolist() == [0, 10, 14]
    keep = torch.nn.functional.pad(am.bool(), (0, 2))
    torch.testing.assert_close(packed[keep], dense[keep], atol=1e-5, rtol=1e-5)
    assert not packed[~keep].any()


def test_two_d_padding_mask_given_directly(varlen_spy):
    q, k, v = _qkv(2, 4, 12, seed=3)
    pad = torch.ones(2, 8, dtype=torch.bool)  # 8 seen tokens, 4 empty static-cache slots
    pad[0, :3] = False
    dense = _attend("never", q, k, v, pad)
    packed = _attend("always", q, k, v, pad)
    assert len(varlen_spy) == 1 and varlen_spy[0]["key"].shape[0] == 5 + 8
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)
    _attend("always", q, k, v, pad)
    assert len(varlen_spy) == 2  # packing metadata cached on the mask, reused


def test_packed_route_applies_dropout_per_sequence(varlen_spy):
    # Training with dropout on the packed route: the packed call gets dropout_p, and each real
    # row equals attention over its sequence's real keys with the keep-mask of that sequence
    # (rows and keys counted from its first real token, flash_dmattn.testing's convention).
    from flash_dmattn.testing import dropout_mask, dropout_rng

    p = 0.3
    am = _padding("left", lengths=(7, 3, SEQ, 5))
    q, k, v = (t.double() for t in _qkv(4, SEQ, SEQ, seed=6))
    module = _Module()
    module.train()
    torch.manual_seed(2)
    rng = dropout_rng("cpu")
    torch.manual_seed(2)
    out, _ = integ.dmattn_attention_forward(module, q, k, v, _mask(am, SEQ, SEQ), dropout=p,
                                            dmattn_varlen="always")
    assert len(varlen_spy) == 1 and varlen_spy[0]["dropout_p"] == p
    keep = dropout_mask(rng, 4, 4, SEQ, SEQ, p)
    assert 0.5 < keep.double().mean() < 0.9
    for b, n in enumerate(am.sum(1).tolist()):
        qb, kb, vb = q[b, :, -n:], k[b, :, -n:].repeat_interleave(2, 0), v[b, :, -n:].repeat_interleave(2, 0)
        s = (qb @ kb.transpose(-1, -2)) * qb.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want = (torch.softmax(s, -1) * keep[b, :, :n, :n] / (1 - p)) @ vb      # (H, n, D)
        torch.testing.assert_close(out[b, -n:], want.transpose(0, 1), rtol=1e-10, atol=1e-10)
        assert not out[b, :-n].any()


def test_auto_routing_with_dropout_draws_one_rng(dense_spy):
    # Deciding the route (auto asks which backend would take a packed call with dropout) draws
    # nothing: the call advances torch's generator by exactly its own dropout draw.
    from flash_dmattn.testing import dropout_rng

    am = _padding("left")
    q, k, v = _qkv(4, SEQ, SEQ, seed=7)
    module = _Module()
    module.train()
    torch.manual_seed(3)
    integ.dmattn_attention_forward(module, q, k, v, _mask(am, SEQ, SEQ), dropout=0.2)
    after_call = torch.randint(0, 1 << 30, (4,))
    torch.manual_seed(3)
    dropout_rng("cpu")
    assert torch.equal(after_call, torch.randint(0, 1 << 30, (4,)))
    assert len(dense_spy) == 1 and dense_spy[0]["dropout_p"] == 0.2


def test_not_routed_when_the_mask_has_more_than_padding(varlen_spy):
    am = _padding("left")
    q, k, v = _qkv(4, SEQ, SEQ, seed=4)
    mask = _mask(am, SEQ, SEQ)
    # a bias on top of the mask (1.2.x / Doge-style per-key bias)
    _attend("always", q, k, v, mask, attention_bias=torch.randn(4, 2, SEQ))
    # a hand-built 4-D mask with the same pattern: nothing says it is only padding
    _attend("always", q, k, v, mask.clone())
    # a sliding window keyword
    _attend("always", q, k, v, mask, sliding_window=4)
    # a sliding-window mask built by transformers
    from transformers import masking_utils

    sw = integ.dmattn_mask(
        batch_size=4, q_length=SEQ, kv_length=SEQ, attention_mask=am.bool(), device="cpu",
        mask_function=masking_utils.sliding_window_causal_mask_function(4),
    )
    _attend("always", q, k, v, sw)
    # a dynamic (top-k) mask: a rewritten bool tensor
    _attend("always", q, k, v, mask & (torch.rand(4, 1, SEQ, SEQ) > 0.5))
    # our mask, edited in place after it was built
    edited = _mask(am, SEQ, SEQ)
    edited[:, :, :, 0] = False
    out = _attend("always", q, k, v, edited)
    assert not varlen_spy
    ref = hf_transformers._get_kernel()(
        **hf_transformers.prepare_attention_call(_Module(), q, k, v, edited, None, 0.0, None, {})
    )
    torch.testing.assert_close(out, ref)


def test_decode_step_keeps_dense_path(varlen_spy, dense_spy):
    am = _padding("left", seq=SEQ + 1)
    q, k, v = _qkv(4, 1, SEQ + 1, seed=5)
    mask = _mask(am, 1, SEQ + 1, q_offset=SEQ)
    _attend("always", q, k, v, mask)
    assert not varlen_spy and len(dense_spy) == 1


def test_mode_sources_and_validation(monkeypatch, varlen_spy):
    am = _padding("right")
    q, k, v = _qkv(4, SEQ, SEQ, seed=6)
    mask = _mask(am, SEQ, SEQ)
    call = lambda **kw: integ.dmattn_attention_forward(_Module(), q, k, v, mask, **kw)  # noqa: E731
    call()  # auto on CPU: torch-reference would run the packed call -> dense
    assert not varlen_spy
    monkeypatch.setenv(hf_varlen.ENV_VAR, "always")
    call()
    assert len(varlen_spy) == 1
    call(dmattn_varlen="never")  # the keyword wins over the environment
    assert len(varlen_spy) == 1
    hf_varlen.set_varlen_mode("never")  # the process-wide setting wins over the environment
    call()
    assert len(varlen_spy) == 1
    hf_varlen.set_varlen_mode(None)
    monkeypatch.setenv(hf_varlen.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=hf_varlen.ENV_VAR):
        call()
    with pytest.raises(ValueError, match="set_varlen_mode"):
        hf_varlen.set_varlen_mode("yes")
    monkeypatch.delenv(hf_varlen.ENV_VAR)
    with pytest.raises(ValueError, match="dmattn_varlen"):
        call(dmattn_varlen=True)


def test_auto_packs_only_for_a_kernel_backend_and_padding(monkeypatch, varlen_spy):
    assert hf_varlen.get_varlen_mode() == "auto"
    q, k, v = _qkv(4, SEQ, SEQ, seed=7)
    padded = _mask(_padding("right"), SEQ, SEQ)
    integ.dmattn_attention_forward(_Module(), q, k, v, padded)
    assert not varlen_spy  # CPU: the packed call would land on torch-reference
    monkeypatch.setattr(hf_varlen, "_packed_backend_name", lambda inputs: "triton")
    integ.dmattn_attention_forward(_Module(), q, k, v, _mask(_padding("right"), SEQ, SEQ))
    assert len(varlen_spy) == 1
    full = torch.ones(4, SEQ, dtype=torch.bool)
    unpadded = integ.dmattn_mask(
        batch_size=4, q_length=SEQ, kv_length=SEQ, attention_mask=full,
        allow_is_causal_skip=False, device="cpu",
    )
    integ.dmattn_attention_forward(_Module(), q, k, v, unpadded)
    assert len(varlen_spy) == 1  # nothing padded: auto keeps the dense path
    integ.dmattn_attention_forward(_Module(), q, k, v, unpadded, dmattn_varlen="always")
    assert len(varlen_spy) == 2


def test_packed_backend_choice_has_no_side_effects(monkeypatch):
    from flash_dmattn.inputs import VarlenInputs

    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    inputs = VarlenInputs.from_args(*(torch.randn(5, 2, 8) for _ in range(3)), cu, cu, 3, 3)
    assert hf_varlen._packed_backend_name(inputs) == "torch-reference"
    monkeypatch.setenv("FLASH_DMATTN_BACKEND", "triton")
    assert hf_varlen._packed_backend_name(inputs) == "triton"


# ---------------------------------------------------------------------------------------------
# whole models
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_logits_packed_vs_dense_vs_eager(side, varlen_spy, dense_spy):
    model = _llama()
    ids, am = _batch(side)
    keep = am.bool()
    with torch.no_grad():
        dense = model(ids, attention_mask=am, dmattn_varlen="never").logits
        n_dense = len(dense_spy)
        assert not varlen_spy and n_dense == 2
        packed = model(ids, attention_mask=am, dmattn_varlen="always").logits
        assert len(varlen_spy) == 2 and len(dense_spy) == n_dense  # every layer packed
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=am).logits
    torch.testing.assert_close(packed[keep], dense[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[keep], eager[keep], atol=1e-5, rtol=1e-5)
    if side == "left":
        # padded query rows are zero in both dmattn paths, so every logit agrees
        torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_gradients_packed_vs_dense(side, varlen_spy):
    model = _llama().train()
    ids, am = _batch(side, seed=1)
    labels = ids.masked_fill(am == 0, -100)  # the usual training setup: padding is not scored
    grads = {}
    for mode in ("never", "always"):
        model.zero_grad()
        loss = model(ids, attention_mask=am, labels=labels, dmattn_varlen=mode).loss
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(varlen_spy) == 2
    assert grads["never"].keys() == grads["always"].keys() and len(grads["never"]) > 10
    for name, g in grads["never"].items():
        torch.testing.assert_close(grads["always"][name], g, atol=2e-5, rtol=1e-4, msg=name)


def test_llama_generate_identical_tokens(varlen_spy, dense_spy):
    model = _llama()
    ids, am = _batch("left", seed=2)
    gen = {}
    with torch.no_grad():
        for mode in ("never", "always"):
            hf_varlen.set_varlen_mode(mode)
            gen[mode] = model.generate(
                ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0
            )
        model.set_attn_implementation("eager")
        gen["eager"] = model.generate(
            ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    assert torch.equal(gen["always"], gen["never"]) and torch.equal(gen["always"], gen["eager"])
    # the prefill was packed (2 layers), the 4 decode steps per layer stayed dense
    assert len(varlen_spy) == 2 and all(c["max_seqlen_q"] > 1 for c in varlen_spy)
    decode = [c for c in dense_spy if c["query"].shape[1] == 1]
    assert len(decode) == 2 * 4 * 2  # both dmattn runs decode densely


def test_sliding_window_model_is_not_packed(varlen_spy, dense_spy):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
    )
    model = MistralForCausalLM._from_config(cfg, attn_implementation="dmattn").eval()
    ids, am = _batch("left", seed=3)
    with torch.no_grad():
        out = model(ids, attention_mask=am, dmattn_varlen="always").logits
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=am).logits
    assert not varlen_spy and len(dense_spy) == 2
    keep = am.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


def test_dynamic_mask_model_is_not_packed(varlen_spy, dense_spy):
    doge = pytest.importorskip("transformers.models.doge", reason="transformers has no Doge")
    cfg = doge.DogeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        keep_window_size=4,
    )
    torch.manual_seed(0)
    model = doge.DogeForCausalLM._from_config(cfg, attn_implementation="dmattn").eval()
    ids, am = _batch("left", seed=4)
    with torch.no_grad():
        model(ids, attention_mask=am, dmattn_varlen="always")
    assert not varlen_spy and len(dense_spy) == 2
    assert all(c["attn_bias"] is not None for c in dense_spy)


# ---------------------------------------------------------------------------------------------
# padding helpers added for the route
# ---------------------------------------------------------------------------------------------
def test_unpad_indices_matches_unpad_input():
    am = _padding("right")
    hidden = torch.randn(*am.shape, 3)
    _, idx, cu, max_len, used = unpad_input(hidden, am)
    idx2, cu2, max2, used2 = unpad_indices(am)
    assert torch.equal(idx, idx2) and torch.equal(cu, cu2) and torch.equal(used, used2)
    assert max_len == max2
    with pytest.raises(TypeError):
        unpad_indices(am.float())
    with pytest.raises(ValueError):
        unpad_indices(am[0])


def test_gather_tokens_reads_strided_views():
    x = torch.randn(3, 4, 5, 2, requires_grad=True)  # heads-first (B, H, L, D)
    view = x.transpose(1, 2)  # (B, L, H, D), first two dims not mergeable
    idx = torch.tensor([0, 3, 4, 11, 14])
    got = gather_tokens(view, idx)
    want = view.reshape(15, 4, 2)[idx]
    assert torch.equal(got, want)
    (g,) = torch.autograd.grad(got.sum(), x)
    (w,) = torch.autograd.grad(want.sum(), x)
    assert torch.equal(g, w)
    assert torch.equal(gather_tokens(x.detach(), torch.tensor([1, 2], dtype=torch.int32)),
                       x.detach().flatten(0, 1)[[1, 2]])
    with pytest.raises(TypeError):
        gather_tokens(view, idx.float())
    with pytest.raises(ValueError):
        gather_tokens(view, idx[None])
