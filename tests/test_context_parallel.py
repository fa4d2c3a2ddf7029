"""Context-parallel attention (flash_dmattn.distributed) on CPU with gloo.

One pool of 4 processes (torch.multiprocessing spawn, gloo) serves every case: groups of 1, 2
and 4 ranks, and a 2x2 DeviceMesh. Each case is built from a seed in float64; the ranks run it
on their shards, send back their output and gradient shards, and this process puts them
together and compares them with one torch-reference call on the whole sequence.
"""
from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from flash_dmattn import KeyIntervals, reference_dmattn_func
from flash_dmattn.distributed import (
    sequence_segments,
    shard_positions,
    shard_segments,
    shard_sequence,
    unshard_sequence,
)
from flash_dmattn.distributed.plan import plan_block
from flash_dmattn.utils.mask import topk_intervals

POOL_SIZE = 4
RESULT_TIMEOUT_S = 120
# float64 cases: the merge by log-sum-exp and the per-block gradient sums only reorder float64
# sums of O(L) terms of size O(1) (observed differences ~1e-14).
TOL64 = dict(rtol=1e-12, atol=1e-12)
# float32 cases against the float64 reference: float32 rounding of every block's output and of
# the merge (eps 1.2e-7, a few dozen terms a row).
TOL32 = dict(rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------
# Problems (built identically here and in the workers)


def make_problem(spec):
    """The whole-sequence tensors of a case: q, k, v, dout, mask, bias, intervals."""
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    dtype = spec.get("dtype", torch.float64)
    B, L, H, Hkv, D = spec["B"], spec["L"], spec["H"], spec["Hkv"], spec["D"]

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    p = dict(q=randn(B, L, H, D), k=randn(B, L, Hkv, D), v=randn(B, L, Hkv, D),
             dout=randn(B, L, H, D))
    mask_shapes = {"per_key": (B, 1, 1, L), "per_query": (B, 1, L, 1), "rows": (B, 1, L, L)}
    bias_shapes = {"per_key": (B, Hkv, 1, L), "per_query": (1, H, L, 1), "rows": (B, H, L, L),
                   "replicated": (1, H, 1, 1), "global_keys": (B, Hkv, 1, L),
                   "per_key_b1h1": (1, 1, 1, L), "per_key_qheads": (1, H, 1, L)}
    p["mask"] = None
    if spec.get("mask"):
        p["mask"] = torch.rand(*mask_shapes[spec["mask"]], generator=g) < 0.75
    p["bias"] = None
    if spec.get("bias"):
        p["bias"] = randn(*bias_shapes[spec["bias"]])
    p["intervals"] = None
    if spec.get("intervals") == "random":  # per kv head and key: any interval, some empty
        start = torch.randint(-3, L, (B, Hkv, L), generator=g)
        p["intervals"] = KeyIntervals(start, start + torch.randint(0, L, (B, Hkv, L), generator=g))
    elif spec.get("intervals") == "window":  # 3 sink tokens and a window of 7, every head
        j = torch.arange(L)
        p["intervals"] = KeyIntervals(torch.where(j < 3, 0, j), torch.where(j < 3, L, j + 7))
    return p


def _shard_dim(kind: str, name: str):
    """The dim along which a rank holds its part, or None (the whole tensor on every rank)."""
    if name == "mask":
        return {"per_key": -1, "per_query": 2, "rows": 2}[kind]
    return {"per_key": -1, "per_query": 2, "rows": 2, "per_key_b1h1": -1,
            "per_key_qheads": -1}.get(kind)


def _run_case(spec, group, rank: int, world: int):
    """This rank's part of a case: outputs and gradients of its shards (numpy), comm bytes."""
    from flash_dmattn.distributed import (
        context_parallel_attention,
        context_parallel_dma_attention,
        context_parallel_selected_attention,
        record_communication,
    )

    p = make_problem(spec)
    layout = spec["layout"]

    def shard(t, dim=1):
        return shard_sequence(t, rank, world, layout, dim)

    frozen = spec.get("frozen", ())  # inputs that need no gradient
    q, k, v = (shard(p[n]).requires_grad_(n not in frozen) for n in ("q", "k", "v"))
    mask = bias = None
    if p["mask"] is not None:
        mask = shard(p["mask"], _shard_dim(spec["mask"], "mask"))
    if p["bias"] is not None:
        dim = _shard_dim(spec["bias"], "bias")
        bias = (p["bias"].clone() if dim is None else shard(p["bias"], dim))
        bias.requires_grad_("bias" not in frozen)
    kwargs = dict(layout=layout, is_causal=spec["causal"], softcap=spec.get("softcap"),
                  backend=spec.get("backend", "torch-reference"))
    kwargs.update(spec.get("group_kwargs", {}) or {"group": group})
    if spec.get("pass_seq_len"):  # the lengths known without an exchange
        kwargs["seq_len"] = spec["L"]
        # (after the group's first call, which exchanges anyway: see agreed_rows)
        from flash_dmattn.distributed.comm import Group

        Group(kwargs["group"], kwargs.get("mesh_dim")).agree(torch.device("cpu"), [0], 1)
    with record_communication() as log:
        if spec["kind"] == "ring":
            attn_mask = mask
            if p["intervals"] is not None:
                attn_mask = (shard(p["intervals"]) if spec.get("intervals_sharded")
                             else p["intervals"])
            out = context_parallel_attention(q, k, v, attn_mask=attn_mask, attn_bias=bias, **kwargs)
        elif spec["kind"] == "selected":
            out = context_parallel_selected_attention(q, k, v, p["intervals"], attn_bias=bias,
                                                      **kwargs)
        else:
            out = context_parallel_dma_attention(q, k, v, bias, spec["window"], **kwargs)
        out.backward(shard(p["dout"]))
    result = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if bias is not None:
        result["dbias"] = bias.grad
    result = {n: t.numpy() for n, t in result.items() if t is not None}
    result["sent"] = dict(log.sent)
    result["received"] = dict(log.received)
    return result


def _worker(rank, tasks, results, store):
    for name in ("FLASH_DMATTN_BACKEND", "FLASH_DMATTN_DISABLE"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=POOL_SIZE, timeout=datetime.timedelta(seconds=60))
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    while True:
        spec = tasks[rank].get()
        if spec is None:
            break
        try:
            if spec.get("error_case"):
                _run_error_case(spec, groups[spec["world"]], rank, spec["world"])
                result = {"no_error": True}
            elif spec["kind"] == "syncs":
                result = _run_sync_count(spec, groups[spec["world"]], rank, spec["world"])
            elif spec["kind"] == "local_calls":
                result = _run_local_calls(spec, groups[spec["world"]], rank, spec["world"])
            elif spec.get("mesh"):
                spec = dict(spec, group_kwargs={"group": mesh, "mesh_dim": "cp"})
                result = _run_case(spec, None, rank % 2, 2)
            else:
                result = _run_case(spec, groups[spec["world"]], rank, spec["world"])
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        results.put((rank, result))
    dist.destroy_process_group()


def _run_sync_count(spec, group, rank: int, world: int):
    """The host synchronisations (flash_dmattn.distributed.syncs.HostSyncs) of one forward and
    one backward of a context-parallel call with ``seq_len``, at each of ``spec["lengths"]``
    (after one untimed call that pays one-off costs): ``{L: (forward sites, backward sites)}``."""
    from flash_dmattn.distributed import context_parallel_attention, context_parallel_dma_attention
    from flash_dmattn.distributed.comm import Group
    from flash_dmattn.distributed.syncs import HostSyncs

    Group(group).agree(torch.device("cpu"), [0], 1)  # the group's first exchange, done
    found = {}
    for L in (spec["lengths"][0],) + tuple(spec["lengths"]):
        case = dict(spec, L=L)
        p = make_problem(case)
        layout = spec["layout"]

        def shard(t, dim=1):
            return shard_sequence(t, rank, world, layout, dim)

        q, k, v = (shard(p[n]).requires_grad_() for n in ("q", "k", "v"))
        bias = shard(p["bias"], -1).requires_grad_()
        kw = dict(group=group, layout=layout, is_causal=True, backend=spec["backend"], seq_len=L)
        with HostSyncs() as fwd:
            if spec["call"] == "dma":
                out = context_parallel_dma_attention(q, k, v, bias, spec["window"], **kw)
            else:
                out = context_parallel_attention(q, k, v, attn_mask=p["intervals"], attn_bias=bias,
                                                 **kw)
        with HostSyncs() as bwd:
            out.backward(shard(p["dout"]))
        found[L] = ([site for site, _ in fwd.events], [site for site, _ in bwd.events])
    return {"syncs": found}


def _run_local_calls(spec, group, rank: int, world: int):
    """The local kernel calls of one forward and one backward of a DMA call on this rank: the
    number of keys of each (LocalKernel.forward / backward wrapped for the call)."""
    from flash_dmattn.distributed import context_parallel_dma_attention, record_communication
    from flash_dmattn.distributed.local import LocalKernel

    p = make_problem(spec)

    def shard(t, dim=1):
        return shard_sequence(t, rank, world, spec["layout"], dim)

    q, k, v = (shard(p[n]).requires_grad_() for n in ("q", "k", "v"))
    bias = shard(p["bias"], -1).requires_grad_()
    keys = {"forward": [], "backward": []}
    forward, backward = LocalKernel.forward, LocalKernel.backward

    def counted_forward(self, q, k, *args, **kwargs):
        keys["forward"].append(k.shape[1])
        return forward(self, q, k, *args, **kwargs)

    def counted_backward(self, dout, q, k, *args, **kwargs):
        keys["backward"].append(k.shape[1])
        return backward(self, dout, q, k, *args, **kwargs)

    LocalKernel.forward, LocalKernel.backward = counted_forward, counted_backward
    try:
        with record_communication() as log:
            out = context_parallel_dma_attention(q, k, v, bias, spec["window"], is_causal=True,
                                                 group=group, layout=spec["layout"],
                                                 backend="torch-reference")
            out.backward(shard(p["dout"]))
    finally:
        LocalKernel.forward, LocalKernel.backward = forward, backward
    return {"keys": keys, "shard": q.shape[1], "received": dict(log.received)}


class Pool:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(POOL_SIZE)]
        self.results = ctx.Queue()
        self.store = tempfile.mktemp(prefix="flash_dmattn_cp_")
        self.procs = mp.spawn(_worker, args=(self.tasks, self.results, self.store),
                              nprocs=POOL_SIZE, join=False)
        self.broken = False

    def run(self, spec):
        """Every participating rank's result, by rank (ranks of the group, in order)."""
        ranks = list(range(POOL_SIZE if spec.get("mesh") else spec["world"]))
        for r in ranks:
            self.tasks[r].put(spec)
        got = {}
        try:
            for _ in ranks:
                rank, res = self.results.get(timeout=RESULT_TIMEOUT_S)
                got[rank] = res
        except queue.Empty:
            self.broken = True
            raise AssertionError(f"no result within {RESULT_TIMEOUT_S} s; ranks done: {sorted(got)}")
        return [got[r] for r in ranks]

    def close(self) -> None:
        if self.broken:
            for proc in self.procs.processes:
                proc.kill()
        else:
            for t in self.tasks:
                t.put(None)
            self.procs.join(timeout=60)
        try:
            os.unlink(self.store)
        except OSError:
            pass


@pytest.fixture(scope="module")
def pool():
    holder = {"pool": Pool()}

    def get():
        if holder["pool"].broken:  # a hung case: start afresh for the next one
            holder["pool"].close()
            holder["pool"] = Pool()
        return holder["pool"]

    yield get
    holder["pool"].close()


# ------------------------------------------------------------------------------------------
# The reference and the comparison


def reference(spec):
    """Output and gradients of one torch-reference call on the whole sequence (float64)."""
    p = make_problem(spec)
    q, k, v = (p[n].double().requires_grad_() for n in ("q", "k", "v"))
    bias = p["bias"].double().requires_grad_() if p["bias"] is not None else None
    mask = p["mask"]
    if spec["kind"] == "ring" and p["intervals"] is not None:
        mask = p["intervals"]
    elif spec["kind"] == "selected":
        mask = p["intervals"]
    elif spec["kind"] == "dma":
        mask = topk_intervals(p["bias"], spec["window"], is_causal=spec["causal"])
    out = reference_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=spec["causal"],
                                softcap=spec.get("softcap"))
    out.backward(p["dout"].double())
    ref = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if bias is not None:
        ref["dbias"] = bias.grad
    return ref


def check(spec, results):
    for res in results:
        assert "error" not in res, res.get("trace", res.get("error"))
    ref = reference(spec)
    tol = TOL64 if spec.get("dtype", torch.float64) == torch.float64 else TOL32
    frozen = {"d" + n for n in spec.get("frozen", ())}
    for name, expected in ref.items():
        if name in frozen:
            assert name not in results[0]
            continue
        parts = [torch.from_numpy(r[name]).double() for r in results]
        dim = 1
        if name == "dbias":
            dim = _shard_dim(spec["bias"], "bias")
        if dim is None:
            # A replicated bias: each rank has the gradient of its own queries.
            got = torch.stack(parts).sum(0)
        else:
            got = unshard_sequence(parts, spec["layout"], dim)
        torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{name}: {m}")


def run_and_check(pool, spec):
    results = pool().run(spec)
    for res in results:
        assert "error" not in res, res.get("trace", res.get("error"))
    # The lengths are exchanged unless seq_len was given and no rank holds a single token.
    world = 2 if spec.get("mesh") else spec["world"]
    lengths = [sum(n for _, n in segs) for segs in sequence_segments(spec["layout"], world, spec["L"])]
    exchanged = world > 1 and not (spec.get("pass_seq_len") and min(lengths) >= 2)
    assert all(bool(res["sent"].get("setup")) == exchanged for res in results), [r["sent"] for r in results]
    if spec.get("mesh"):  # two data-parallel replicas of the same problem
        check(spec, results[:2])
        check(spec, results[2:])
    else:
        check(spec, results)
    return results


BASE = dict(B=2, L=32, H=4, Hkv=2, D=8)


def _case(kind, world, layout, causal, **extra):
    return dict(BASE, kind=kind, world=world, layout=layout, causal=causal, **extra)


def _id(spec):
    parts = [spec["kind"], f"P{'2x2' if spec.get('mesh') else spec['world']}", spec["layout"],
             "causal" if spec["causal"] else "full"]
    for key in ("mask", "bias", "intervals", "backend", "window"):
        if spec.get(key) is not None:
            parts.append(f"{key}={spec[key]}")
    if spec.get("softcap"):
        parts.append("softcap")
    if spec.get("frozen"):
        parts.append("frozen=" + "".join(spec["frozen"]))
    if spec.get("L", BASE["L"]) != BASE["L"]:
        parts.append(f"L{spec['L']}")
    if spec.get("pass_seq_len"):
        parts.append("seq_len")
    if spec.get("dtype") == torch.float32:
        parts.append("fp32")
    return "-".join(str(p) for p in parts)


RING_CASES = [
    _case("ring", world, layout, causal, mask="per_key", bias="per_key")
    for world in (2, 4) for layout in ("contiguous", "zigzag") for causal in (True, False)
] + [
    _case("ring", 4, "zigzag", True, mask="per_query", bias="rows", softcap=2.5),
    _case("ring", 2, "contiguous", False, mask="rows", bias="per_query"),
    _case("ring", 4, "zigzag", True, intervals="random", intervals_sharded=True,
          bias="per_key", softcap=2.5),
    _case("ring", 2, "contiguous", True, intervals="window", bias="replicated"),
    _case("ring", 4, "contiguous", False, intervals="random", intervals_sharded=True,
          bias="global_keys", Hkv=4),
    _case("ring", 4, "zigzag", False, intervals="window", mask="per_key", bias="per_key"),
    _case("ring", 1, "zigzag", True, bias="per_key", mask="per_key"),
    # K/V frozen: no accumulators travel except the per-key dbias (and the ring's K/V)
    _case("ring", 4, "zigzag", True, bias="per_key", frozen=("k", "v")),
    _case("ring", 2, "contiguous", True, mask="per_key", bias="per_key", frozen=("q", "v")),
    dict(_case("ring", 2, "zigzag", True, bias="per_key"), mesh=True),
    # float32 through auto-dispatch (the torch-reference backend on CPU)
    _case("ring", 2, "zigzag", True, bias="per_key", mask="per_key", dtype=torch.float32,
          backend=None),
    # Lengths the layout does not divide: shards of 7, 7, 8, 8 (zigzag pieces 4,4,4,4,4,4,3,3),
    # 8, 8, 7, 7 (contiguous), 17 and 16, and 1, 1, 2, 2 (two zigzag pieces without a token).
    _case("ring", 4, "zigzag", True, mask="per_key", bias="per_key", L=30),
    _case("ring", 4, "contiguous", True, intervals="random", intervals_sharded=True,
          bias="per_key", softcap=2.5, L=30),
    _case("ring", 2, "zigzag", False, mask="rows", bias="per_query", L=33),
    _case("ring", 4, "zigzag", True, mask="per_query", bias="rows", intervals=None, L=31, Hkv=1),
    _case("ring", 4, "zigzag", True, intervals="window", bias="global_keys", L=29),
    _case("ring", 4, "zigzag", True, bias="per_key", mask="per_key", L=6, frozen=("q",)),
    dict(_case("ring", 2, "zigzag", True, bias="per_key", L=27), mesh=True),
    # seq_len given: no exchange (ranks of one token: exchanged anyway)
    _case("ring", 4, "zigzag", True, mask="per_key", bias="per_key", L=30, pass_seq_len=True),
    _case("ring", 2, "zigzag", False, mask="rows", bias="per_query", L=33, pass_seq_len=True),
    _case("ring", 4, "contiguous", True, intervals="random", intervals_sharded=True,
          bias="replicated", L=32, pass_seq_len=True),
    _case("ring", 4, "zigzag", True, bias="per_key", mask="per_key", L=6, pass_seq_len=True),
]

DMA_CASES = [
    _case("dma", world, layout, causal, bias="per_key", window=5, softcap=3.0 if causal else None)
    for world in (2, 4) for layout in ("contiguous", "zigzag") for causal in (True, False)
] + [
    _case("dma", 2, "contiguous", True, bias="per_key_b1h1", window=4),
    _case("dma", 1, "zigzag", True, bias="per_key", window=6),
    _case("selected", 4, "zigzag", True, intervals="window", bias="per_key_qheads"),
    _case("selected", 2, "contiguous", False, intervals="random"),
    _case("dma", 4, "zigzag", True, bias="per_key", window=5, frozen=("k", "v")),
    _case("dma", 2, "zigzag", False, bias="per_key", window=5, frozen=("q", "k")),
    dict(_case("dma", 2, "zigzag", True, bias="per_key", window=5), mesh=True),
    # lengths the layout does not divide (see RING_CASES)
    _case("dma", 4, "zigzag", True, bias="per_key", window=5, L=30, softcap=3.0),
    _case("dma", 2, "contiguous", False, bias="per_key_b1h1", window=4, L=33),
    _case("selected", 4, "contiguous", False, intervals="random", bias="per_key", L=27),
    _case("selected", 4, "zigzag", True, intervals="window", L=6),
    _case("dma", 4, "zigzag", True, bias="per_key", window=5, L=30, pass_seq_len=True),
    _case("selected", 4, "contiguous", False, intervals="random", bias="per_key", L=27,
          pass_seq_len=True),
    # The one local call over [received keys ; own keys] per pass: odd shards (17 and 16; 8, 8,
    # 8, 7 with zigzag pieces of 4 and 3), one interval head (Hkv 1), intervals and a bias per
    # kv head, a bias per query head, gradients of some inputs only (the bias alone; all but
    # the bias).
    _case("dma", 2, "zigzag", True, bias="per_key", window=6, L=33, softcap=3.0),
    _case("dma", 4, "zigzag", True, bias="per_key", window=4, L=31, Hkv=1),
    _case("dma", 4, "contiguous", True, bias="per_key_b1h1", window=7, L=29),
    _case("selected", 4, "zigzag", True, intervals="random", bias="per_key", L=29),
    _case("selected", 2, "zigzag", False, intervals="window", bias="per_key_qheads", L=27),
    _case("dma", 2, "contiguous", True, bias="per_key", window=5, L=31, frozen=("q", "k", "v")),
    _case("dma", 4, "zigzag", True, bias="per_key", window=5, L=30, frozen=("bias",)),
]


@pytest.mark.parametrize("spec", RING_CASES, ids=_id)
def test_ring_matches_one_process(pool, spec):
    run_and_check(pool, spec)


@pytest.mark.parametrize("spec", DMA_CASES, ids=_id)
def test_selected_keys_match_one_process(pool, spec):
    run_and_check(pool, spec)


def test_triton_kernels_as_local_calls(pool):
    # The kernel backend's op pair (Triton's interpreter on CPU) behind the ring and the DMA path.
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU only through the interpreter")
    small = dict(B=1, L=32, H=2, Hkv=1, D=16, dtype=torch.float32, backend="triton")
    run_and_check(pool, dict(_case("ring", 2, "zigzag", True, bias="per_key", mask="per_key"),
                             **small))
    run_and_check(pool, dict(_case("dma", 2, "zigzag", True, bias="per_key", window=6), **small))
    # shards of 15 and 16 tokens
    run_and_check(pool, dict(_case("ring", 2, "zigzag", True, bias="per_key", mask="per_key"),
                             **dict(small, L=31)))
    run_and_check(pool, dict(_case("dma", 2, "contiguous", True, bias="per_key", window=6),
                             **dict(small, L=31)))


def test_dma_moves_only_the_selected_keys(pool):
    spec = _case("dma", 4, "zigzag", True, bias="per_key", window=3, L=64, D=16)
    results = run_and_check(pool, spec)
    ring = pool().run(_case("ring", 4, "zigzag", True, bias="per_key", L=64, D=16))
    p = make_problem(spec)
    B, L, Hkv, D, world = spec["B"], spec["L"], spec["Hkv"], spec["D"], spec["world"]
    n = L // world
    # Which keys each rank's queries see, from the dense mask of the selection.
    visible = topk_intervals(p["bias"], spec["window"], is_causal=True).to_dense(L)
    visible &= torch.ones(L, L, dtype=torch.bool).tril()  # (B, Hkv, L, L)
    row_bytes = (2 * D + 1) * 8  # K and V of one kv head, and its bias value (float64)
    for rank, res in enumerate(results):
        mine = shard_positions("zigzag", rank, world, n)
        others = torch.ones(L, dtype=torch.bool)
        others[mine] = False
        needed = visible[:, :, mine].any(2) & others  # (B, Hkv, L)
        expected = int(needed.sum()) * row_bytes
        assert res["received"]["kv"] == expected
        # the gradients of the same rows go back, in the key's dtype
        assert res["sent"]["grad"] == expected
        assert res["received"]["bias"] == (world - 1) * B * Hkv * n * 8
        # The ring moves every other rank's K/V and bias in each pass (forward, and again in
        # the backward) and the gradient accumulators P hops (float64 here).
        ring_pass = (world - 1) * B * n * Hkv * row_bytes
        assert ring[rank]["received"]["kv"] == 2 * ring_pass
        assert ring[rank]["received"]["grad"] == world * B * n * Hkv * row_bytes
        assert res["received"]["kv"] < ring_pass / 2


@pytest.mark.parametrize("call,world,backend", [
    ("dma", 1, "torch-reference"), ("dma", 2, "torch-reference"), ("dma", 4, "torch-reference"),
    ("dma", 2, "triton"), ("ring", 2, "torch-reference"),
], ids=lambda x: str(x))
def test_host_syncs_per_call_do_not_grow_with_length(pool, call, world, backend):
    # Counted on CPU by HostSyncs (item / tolist / nonzero / bool indexing / unique / copies to
    # the host), per forward and per backward, with seq_len: the DMA path waits once, for the
    # selection's buffer sizes, and not at all on one rank; the ring never. The local kernels
    # (Triton's interpreter here, the GPU's kernels on a GPU) plan without waiting: every call
    # carries the selection's window promise, and the backward reuses the forward's plan.
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels run on CPU only through the interpreter")
    spec = dict(B=1, H=2, Hkv=1, D=16, kind="syncs", call=call, world=world, layout="zigzag",
                backend=backend, bias="per_key", window=6, lengths=(32, 128),
                intervals="window" if call == "ring" else None,
                dtype=torch.float32 if backend == "triton" else torch.float64)
    results = pool().run(spec)
    expected = 1 if call == "dma" and world > 1 else 0
    for res in results:
        assert "error" not in res, res.get("trace", res.get("error"))
        for L, (fwd, bwd) in res["syncs"].items():
            assert len(fwd) == expected and bwd == [], (L, fwd, bwd)
            assert all("flash_dmattn/distributed/selected.py" in site for site in fwd), fwd


@pytest.mark.parametrize("world,layout,L", [(2, "zigzag", 33), (4, "zigzag", 30),
                                            (4, "contiguous", 31)])
def test_dma_makes_one_local_call_a_pass(pool, world, layout, L):
    # Every rank attends to [received keys ; own keys] in one local call per pass: no partial
    # outputs to merge, no partial gradients to sum. A rank that receives M keys calls with
    # M + n keys; one whose queries need no other rank's key (contiguous rank 0) with its n.
    spec = dict(BASE, kind="local_calls", world=world, layout=layout, L=L, bias="per_key",
                window=5)
    results = pool().run(spec)
    for rank, res in enumerate(results):
        assert "error" not in res, res.get("trace", res.get("error"))
        n, keys = res["shard"], res["keys"]
        assert len(keys["forward"]) == 1 and keys["backward"] == keys["forward"], (rank, keys)
        receives = bool(res["received"].get("kv"))
        assert (keys["forward"][0] > n) == receives, (rank, n, keys, res["received"])
    if layout == "contiguous":
        assert results[0]["keys"]["forward"] == [results[0]["shard"]]


def test_host_syncs_counter_sees_the_waits():
    # HostSyncs itself: what makes a GPU host wait is counted, with the line that asked.
    from flash_dmattn.distributed.syncs import HostSyncs

    x = torch.arange(10.0)
    tolist = torch.Tensor.tolist
    with HostSyncs() as syncs:
        x.sum().item()
        x.tolist()
        x[x > 3]
        torch.nonzero(x)
        torch.unique(x)
        if x[0]:
            pass
        x.cumsum(0)[:2] + x[torch.tensor([1, 2])]  # none: sizes known from the shapes
    assert syncs.count == 6, syncs.report()
    assert all("test_context_parallel.py" in site for site, _ in syncs.events), syncs.events
    assert torch.Tensor.tolist is tolist  # restored


ERROR_CASES = [
    (dict(bias="per_key", layout="diagonal"), ValueError, "layout must be one of"),
    (dict(bad_mask=True), ValueError, "this rank's queries and this rank's keys"),
    (dict(backend="flex"), ValueError, "no separate forward/backward"),
    (dict(kind="selected", intervals="window", intervals_sharded=True), ValueError,
     "cover the whole sequence"),
    # shards of 18 and 16 tokens: the zigzag split of 34 over 2 ranks is 17 and 17
    (dict(L=34, cut=(18, 16)), ValueError, "the ranks hold [18, 16] tokens, but the zigzag layout"),
    (dict(L=34, cut=(17, 17), layout="contiguous", bias="per_key", bias_on=(0,)), ValueError,
     "attn_bias was passed on ranks [0] only"),
    (dict(bad_bias=True), ValueError, "attn_bias: the key dim has sizes [12, 20] on the ranks"),
    (dict(L=3, cut=(3, 0), layout="contiguous"), ValueError, "every rank needs at least one token"),
    (dict(kind="dma", bias="per_key", L=30, cut=(16, 14), layout="contiguous"), ValueError,
     "the ranks hold [16, 14] tokens, but the contiguous layout"),
    # seq_len given: each rank checks its own length (both wrong here)
    (dict(L=32, seq_len=34), ValueError, "tokens, but the zigzag layout of seq_len=34 gives"),
]


def _run_error_case(spec, group, rank, world):
    from flash_dmattn.distributed import (
        context_parallel_attention,
        context_parallel_dma_attention,
        context_parallel_selected_attention,
    )

    p = make_problem(spec)
    layout = spec["layout"]
    shard_layout = layout if layout in ("contiguous", "zigzag") else "contiguous"

    def shard(t, dim=1):
        return shard_sequence(t, rank, world, shard_layout, dim)

    cut = spec.get("cut")  # shards of these lengths, cut contiguously, whatever the layout

    def part(t, dim=1):
        if cut is None:
            return shard(t, dim)
        return t.narrow(dim, sum(cut[:rank]), cut[rank])

    q, k, v = (part(p[x]) for x in ("q", "k", "v"))
    kw = dict(group=group, layout=layout, backend=spec.get("backend", "torch-reference"))
    if spec.get("seq_len"):
        kw["seq_len"] = spec["seq_len"]
    if spec["kind"] == "selected":
        return context_parallel_selected_attention(q, k, v, shard(p["intervals"]), **kw)
    mask = None
    if spec.get("bad_mask"):  # (this rank's queries, this rank's keys): meaningless
        n = q.shape[1]
        mask = torch.ones(1, 1, n, n, dtype=torch.bool)
    if rank in spec.get("float_mask_on", ()):  # fails that rank's own checks
        mask = torch.ones(1, 1, 1, q.shape[1])
    bias = None
    if p["bias"] is not None and rank in spec.get("bias_on", range(world)):
        bias = part(p["bias"], -1)
    if spec["kind"] == "dma":
        return context_parallel_dma_attention(q, k, v, bias, 4, **kw)
    if spec.get("bad_bias"):  # key dims 12 and 20: neither the shard lengths (16) nor L (32)
        bias = torch.zeros(1, 1, q.shape[1], 12 if rank == 0 else 20, dtype=q.dtype)
    return context_parallel_attention(q, k, v, attn_mask=mask, attn_bias=bias, **kw)


@pytest.mark.parametrize("extra,exc_type,message", ERROR_CASES,
                         ids=[c[2].split()[0] + "-" + str(i) for i, c in enumerate(ERROR_CASES)])
def test_errors(pool, extra, exc_type, message):
    spec = dict(_case("ring", 2, "zigzag", True), **extra)
    spec["error_case"] = True
    results = pool().run(spec)
    for res in results:
        assert res.get("error", "").startswith(exc_type.__name__), res
        assert message in res["error"], res["error"]


def test_a_rank_failing_its_own_checks_fails_every_rank(pool):
    # Rank 1's mask is not bool: it raises its TypeError, rank 0 (whose arguments are fine)
    # raises too instead of waiting for rank 1's K/V.
    spec = dict(_case("ring", 2, "zigzag", True), error_case=True, float_mask_on=(1,))
    first, second = pool().run(spec)
    assert second["error"].startswith("TypeError: attn_mask must be bool"), second
    assert first["error"].startswith("ValueError: rank(s) [1] of the context-parallel group "
                                     "rejected their arguments"), first
    # and the group still works afterwards
    run_and_check(pool, _case("ring", 2, "zigzag", True, bias="per_key"))


# ------------------------------------------------------------------------------------------
# Without processes: the layouts and the planner


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layout_round_trip(layout):
    world, L = 4, 24
    x = torch.arange(2 * L).view(2, L)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    for r, s in enumerate(shards):
        assert torch.equal(s[0], shard_positions(layout, r, world, L // world))
    if layout == "zigzag":
        assert shard_segments(layout, 1, world, 6) == ((3, 3), (18, 3))
    intervals = KeyIntervals(torch.arange(L), torch.arange(L) + 5)
    part = shard_sequence(intervals, 2, world, layout)
    assert torch.equal(part.start[0, 0], shard_positions(layout, 2, world, L // world).int())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layout_of_any_length(layout):
    # Lengths the pieces do not divide: the first L mod pieces pieces get a token more.
    for world in (1, 2, 3, 4):
        for L in range(world, 4 * world + 9):
            x = torch.arange(L).view(1, L)
            shards = [shard_sequence(x, r, world, layout) for r in range(world)]
            assert torch.equal(unshard_sequence(shards, layout), x)
            segs = sequence_segments(layout, world, L)
            lengths = [s.shape[1] for s in shards]
            assert min(lengths) >= 1 and max(lengths) - min(lengths) <= (2 if layout == "zigzag" else 1)
            for r, s in enumerate(shards):
                assert torch.equal(s[0], shard_positions(layout, r, world, seq_len=L))
                assert shard_segments(layout, r, world, seq_len=L) == segs[r]
                if L % (world * (2 if layout == "zigzag" else 1)) == 0:
                    assert segs[r] == shard_segments(layout, r, world, L // world)
    assert sequence_segments("zigzag", 4, 30)[0] == ((0, 4), (27, 3))
    assert sequence_segments("zigzag", 4, 6)[3] == ((3, 1), (4, 1))
    assert sequence_segments("zigzag", 4, 6)[0] == ((0, 1),)  # its second piece has no token
    with pytest.raises(ValueError, match="without a token"):
        sequence_segments(layout, 4, 3)
    with pytest.raises(ValueError, match=r"the ranks hold \[2, 3\] tokens, but the"):
        unshard_sequence([torch.zeros(1, 2), torch.zeros(1, 3)], layout)  # 5 tokens: 3 and 2


def _assert_exact_cover(q_segs, k_segs, causal, consecutive):
    """plan_block's calls cover every visible (query, key) pair once and no hidden one."""
    def positions(segs):
        return torch.cat([torch.arange(a, a + n) for a, n in segs])

    q_pos, k_pos = positions(q_segs), positions(k_segs)
    calls = plan_block(q_segs, k_segs, causal, consecutive)
    covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
    for c in calls:
        (r0, r1), (c0, c1) = c.rows, c.cols
        assert r1 > r0 and c1 > c0, calls
        i = torch.arange(r1 - r0)[:, None]
        j = torch.arange(c1 - c0)[None, :]
        local = (j <= i + (c1 - c0) - (r1 - r0)) if c.causal else torch.ones_like(i * j, dtype=torch.bool)
        covered[r0:r1, c0:c1] += local.long()
        # columns' global positions and (when asked) consecutive query positions
        cols = torch.cat([torch.arange(a, b) for a, b in c.key_ranges])
        assert torch.equal(cols, k_pos[c0:c1])
        if consecutive:
            assert torch.equal(q_pos[r0:r1], torch.arange(c.query_pos, c.query_pos + r1 - r0))
    visible = (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    assert torch.equal(covered, visible.long()), (q_segs, k_segs, calls)
    return calls


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("consecutive", [True, False])
def test_plan_covers_exactly_the_visible_pairs(layout, causal, consecutive):
    for world in range(1, 6):
        for L in (6 * world, 6 * world + 1, 6 * world + world + 1):  # equal and unequal shards
            segments = sequence_segments(layout, world, L)
            for rank in range(world):
                for src in range(world):
                    calls = _assert_exact_cover(segments[rank], segments[src], causal, consecutive)
                    # causal contiguous: blocks after every query are never computed
                    if causal and layout == "contiguous" and src > rank:
                        assert calls == []


@pytest.mark.parametrize("consecutive", [True, False])
def test_plan_of_any_segments(consecutive):
    # Segments that overlap without being the same (no layout makes them): diagonals off the
    # bottom-right corner, split into a causal call and a full one.
    g = torch.Generator().manual_seed(0)

    def segs():
        a, n = (int(x) for x in torch.randint(0, 12, (2,), generator=g))
        if torch.rand(1, generator=g) < 0.5:
            return ((a, n + 1),)
        b = a + n + 1 + int(torch.randint(0, 6, (1,), generator=g))
        return ((a, n + 1), (b, int(torch.randint(1, 8, (1,), generator=g))))

    for _ in range(400):
        for causal in (True, False):
            _assert_exact_cover(segs(), segs(), causal, consecutive)
    # e.g. queries 0..5 against keys 2..9: rows 2..5 see a growing prefix, rows 0..1 nothing
    calls = _assert_exact_cover(((0, 6),), ((2, 8),), True, True)
    assert [(c.rows, c.cols, c.causal) for c in calls] == [((2, 6), (0, 4), True)]


def _torchrun(nproc: int, *args: str, cpu: bool = True, timeout: int = 300):
    """``python -m torch.distributed.run --standalone`` of ``args`` (a script of the repository
    and its arguments) on ``nproc`` processes, the checkout first on PYTHONPATH; asserts that it
    succeeded. ``cpu``: on CPU (gloo), without the test session's backend choices."""
    import subprocess
    import sys

    from tool_env import ROOT, tool_env

    drop = ("TRITON_INTERPRET", "FLASH_DMATTN_BACKEND", "FLASH_DMATTN_DISABLE") if cpu else \
        ("TRITON_INTERPRET",)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), *args]
    res = subprocess.run(cmd, cwd=ROOT, env=tool_env(env), capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res


def test_example_under_torchrun():
    # examples/context_parallel.py as documented, on CPU (gloo), checked against one process.
    res = _torchrun(2, "examples/context_parallel.py", "--seq-len", "256", "--heads", "4",
                    "--kv-heads", "2", "--head-dim", "16", "--window", "32", "--dtype", "fp64")
    assert res.stdout.count("vs one process") == 4  # ring and DMA, on both ranks
    assert "rank 1/2: 256 tokens, zigzag layout" in res.stdout


def test_cp_profile_script_under_torchrun():
    # tools/cp_profile.py as gpu_cp.sh runs it (PROFILE_S), on CPU with gloo and tiny sizes:
    # the DMA call on 2 ranks, its host waits, and the one-rank comparison with the plain call.
    out = _torchrun(2, "tools/cp_profile.py", "--per-gpu", "32", "--window", "4", "--repeats",
                    "1", "--top", "3").stdout
    assert "== context_parallel_dma_attention on 2 rank(s), L=64" in out, out
    assert "host synchronisations of one fwd+bwd (HostSyncs), by rank: [1, 1]" in out, out
    assert "selected.py" in out and "-- top ops by CPU time" in out, out
    assert "== one rank at L=32" in out and "host synchronisations (HostSyncs): CP 0" in out, out
    # the context-parallel call's phases (cp.<name> ranges), in step order
    phases = [line.split()[0] for line in out.split("-- phases")[1].splitlines()[1:]
              if line.startswith("  ")]
    assert phases[:4] == ["forward", "cp.gather_bias", "cp.topk", "cp.selection"], out
    assert "cp.local_forward" in phases and "cp.wait_grad" in phases, out


def test_cp_profile_device_timeline():
    # tools/cp_profile.py's device timeline on a made-up trace (GPU traces exist only on GPUs):
    # the compute stream's idle stretches and how much of each NCCL kernel it overlapped.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tool_env import load_tool

    tool = load_tool("cp_profile")

    def ev(name, start, end, device=True, stream=7):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA if device else DeviceType.CPU,
                               device_resource_id=stream,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [
        ev("forward", 0, 900, device=False), ev("cp.send_kv", 10, 20, device=False),
        ev("cp.local_forward", 30, 40, device=False),
        ev("cp.local_forward", 1300, 2000), ev("cp.send_kv", 1000, 1500),
        ev("index_select", 1000, 1100), ev("fwd_kernel", 1300, 2000),  # 200 us idle between
        ev("ncclDevKernel_SendRecv", 1050, 1450, stream=9),  # busy 200 of its 400 us
    ]
    text, stats = tool.timeline(SimpleNamespace(events=lambda: events), top=5)
    assert stats["span"] == 1000 and stats["busy"] == 800 and stats["n_gaps"] == 1
    assert stats["nccl"] == 400 and stats["exposed"] == 200
    assert "idle     0.10 +   0.20 ms  in cp.local_forward" in text, text
    assert "compute busy   0.20 / idle   0.20 ms  in cp.send_kv" in text, text
    assert "cp.local_forward   host     0.03 +   0.01 ms   device     0.30 +   0.70 ms" in text, text
    assert "rank 3:    1.00 ms" in tool.rank_line(3, stats)


def test_cp_benchmark_quick(tmp_path):
    # The cp suite on CPU: one torchrun (gloo) per variant, rows and the targets' summary.
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLASH_DMATTN_BACKEND", "FLASH_DMATTN_DISABLE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--suite", "cp", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    rows = json.loads((tmp_path / "cpu" / "quick-cp.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 6, [(r["impl"], r["notes"]) for r in rows]
    by = {(r["shape"]["kind"], r["impl"]): r for r in rows}
    for kind in ("dense", "dma"):
        base = by[(kind, "flash_dmattn_func (one call, 1 GPU)")]
        assert base["fwd_ms"] > 0 and base["fwd_bwd_ms"] > 0
    two = by[("dma", "context_parallel x2 contiguous")]
    # float32 norms of the output and gradients agree with the one-process call
    assert two["rel_err"] is not None and two["rel_err"] < 1e-5
    assert 0.5 < two["ratios"]["traffic / (selected K/V + bias)"] <= 2.0
    assert by[("dense", "context_parallel x2 zigzag")]["ratios"]["efficiency fwd+bwd"] > 0
    md = (tmp_path / "cpu" / "quick-cp.md").read_text()
    assert "| DMA traffic per rank and pass <= 2.0x" in md and "## cp" in md


@pytest.mark.gpu
@pytest.mark.parametrize("gpus,layout,seq_len", [
    (2, "zigzag", 8192), (2, "contiguous", 8191),  # 8191: shards of 4096 and 4095
    (4, "contiguous", 8192), (4, "zigzag", 8190),  # 8190: shards of 2047, 2047, 2048, 2048
], ids=lambda x: str(x))
def test_example_on_gpus(gpus, layout, seq_len):
    # NCCL, bf16, the backend auto-dispatch picks; the example exits 1 when a shard of the output
    # or of a gradient is off (see its check_against_one_process).
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {torch.cuda.device_count()}")
    res = _torchrun(gpus, "examples/context_parallel.py", "--seq-len", str(seq_len), "--layout",
                    layout, "--window", "512", "--heads", "16", "--kv-heads", "4", "--head-dim",
                    "128", "--check", cpu=False, timeout=900)
    print(res.stdout)  # every rank's errors against one process (pytest -rP shows them)
    assert res.stdout.count("vs one process") == 2 * gpus
    assert f"rank {gpus - 1}/{gpus}: {seq_len} tokens, {layout} layout" in res.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merger_merges_each_row_range_once(dtype):
    """The merger against a plain log-sum-exp merge in float64: rows one call reaches, two
    calls, three and four, calls whose rows see no key (lse -inf), and rows no call reaches
    (0, -inf)."""
    from flash_dmattn.distributed.local import Merger

    gen = torch.Generator().manual_seed(4)
    B, n, H, D = 2, 40, 3, 5
    calls = [(0, 10), (20, 30), (5, 15), (0, 10), (25, 35), (12, 13), (0, 4)]
    merger = Merger(B, n, H, D, dtype, "cpu", calls)
    want_out = torch.zeros(B, n, H, D, dtype=torch.float64)
    want_lse = torch.full((B, H, n), float("-inf"), dtype=torch.float64)
    for i, (r0, r1) in enumerate(calls):
        out = torch.randn(B, r1 - r0, H, D, generator=gen).to(dtype)
        lse = torch.randn(B, H, r1 - r0, generator=gen)
        if i == 4:
            lse[:, :, :3] = float("-inf")  # rows of this call that see no key
            out[:, :3] = 0
        merger.add((r0, r1), out, lse.double() if dtype == torch.float64 else lse)
        for r in range(r0, r1):
            a, b = want_lse[:, :, r], lse[:, :, r - r0].double()
            m = torch.logaddexp(a, b)
            ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
            wa, wb = torch.exp(a - ref), torch.exp(b - ref)
            want_out[:, r] = want_out[:, r] * wa[..., None] + out[:, r - r0].double() * wb[..., None]
            want_lse[:, :, r] = m
    got_out, got_lse = merger.result()
    assert got_out.dtype == dtype
    # bfloat16: one rounding of the float32 sum (2**-8 relative)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out.double(), want_out, **tol)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    if dtype == torch.bfloat16:  # rounded once: within half an ulp of the float64 merge
        assert torch.equal(got_out, want_out.to(dtype))
    assert torch.isinf(got_lse[:, :, 35:]).all() and (got_out[:, 35:] == 0).all()
    # One call on every row: its output is the result (no copy).
    one = Merger(B, n, H, D, dtype, "cpu", [(0, n)])
    out, lse = torch.randn(B, n, H, D).to(dtype), torch.randn(B, H, n)
    one.add((0, n), out, lse)
    assert one.result()[0] is out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulator_sums_each_term_once(dtype):
    """Accumulator: ranges of one, two and three terms and none, along dim 1 and dim -1,
    each sum formed in float32 and rounded once; one term over the whole dim is the result."""
    from flash_dmattn.distributed.local import Accumulator

    gen = torch.Generator().manual_seed(5)
    for dim, shape in ((1, (2, 30, 3, 4)), (-1, (2, 3, 1, 30))):
        ranges = [(0, 12), (8, 20), (10, 14), (22, 30)]  # 18..22 none, 10..12 three terms
        acc = Accumulator(shape, dim, ranges, dtype, "cpu")
        want = torch.zeros(shape, dtype=torch.float64)
        for r0, r1 in ranges:
            part_shape = list(shape)
            part_shape[dim] = r1 - r0
            t = torch.randn(*part_shape, generator=gen).to(dtype)
            acc.add((r0, r1), t)
            want.narrow(dim % 4, r0, r1 - r0).add_(t.double())
        got = acc.result()
        assert got.dtype == dtype
        if dtype == torch.bfloat16:
            # float32 sums of at most three bfloat16 terms are exact: one rounding
            assert torch.equal(got, want.to(torch.float32).to(dtype))
        else:
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    whole = torch.randn(2, 30, 3, 4).to(dtype)
    one = Accumulator(whole.shape, 1, [(0, 30)], dtype, "cpu")
    one.add((0, 30), whole)
    assert one.result() is whole
    # half terms into a float32 sum: no rounding to half on the way
    a, b = torch.tensor([[1.0]], dtype=torch.bfloat16), torch.tensor([[2 ** -9]], dtype=torch.bfloat16)
    two = Accumulator((1, 1), 1, [(0, 1), (0, 1)], torch.float32, "cpu")
    two.add((0, 1), a)
    two.add((0, 1), b)
    assert two.result().item() == 1.0 + 2 ** -9


def test_bounds_of_a_call_over_two_pieces():
    # A zigzag shard's two pieces as one call: the translated bounds show each row exactly the
    # keys its global position sees; and the window promise a call passes on.
    from flash_dmattn.distributed.local import LocalKernel, translate_bounds

    g = torch.Generator().manual_seed(6)
    L, ranges = 40, ((5, 12), (27, 35))  # rows 0..6 at positions 5..11, rows 7..14 at 27..34
    rows = torch.cat([torch.arange(a, b) for a, b in ranges])
    start = torch.randint(-3, L + 3, (1, 2, 9), generator=g, dtype=torch.int32)
    end = start + torch.randint(0, L, (1, 2, 9), generator=g, dtype=torch.int32)
    bounds = torch.stack([start, end])
    for num_cols in (9, 20):  # bottom-right alignment: row i sits at i + Lk - Lq
        local = translate_bounds(bounds, ranges, len(rows), num_cols).long()
        pos = torch.arange(len(rows)) + num_cols - len(rows)
        seen = (local[0, ..., None, :] <= pos[:, None]) & (pos[:, None] < local[1, ..., None, :])
        want = (start[..., None, :] <= rows[:, None]) & (rows[:, None] < end[..., None, :])
        assert torch.equal(seen, want)
    kernel = LocalKernel("torch-reference", window=64)
    assert kernel.window_for(((0, 100),), 500) == 64
    assert kernel.window_for(((0, 100), (300, 400)), 500) == 128  # a jump inside a tile
    assert kernel.window_for(((0, 100), (300, 400)), 500, ((0, 100), (300, 400))) == 64
    assert kernel.window_for(((0, 100), (300, 400)), 500, ((150, 200),)) == 128  # keys between
    assert kernel.window_for(((0, 2048), (6144, 8192)), 5000) == 64  # a jump between tiles
    assert kernel.window_for(((0, 100),), 50) == 49  # no more keys than the call has
    assert LocalKernel("torch-reference").window_for(((0, 100),), 500) == 0
