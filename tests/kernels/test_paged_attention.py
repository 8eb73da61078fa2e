"""Triton paged attention (write, decode, prefill, backend) against the PyTorch reference.

CPU: the Triton interpreter runs a few small cases (fp32 and fp16; the interpreter's tl.dot reads
bf16 as raw integers, so bf16 attention is checked on the GPU only). GPU (@pytest.mark.gpu): a grid
over GQA ratios, block sizes, head dims, odd and long lengths, mixed and chunked batches.
Errors are ‖out − ref‖ / ‖ref‖ against the reference run in fp32 on upcast inputs.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.kernels import paged_attention as pa  # noqa: E402
from pagedmoe.kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


if INTERPRET:
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()


def make_batch(seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, device=DEVICE, seed=0):
    """Random q and caches with scattered block tables; unused cache slots hold NaN to catch stray reads."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).int()
    width = max(blocks_per_seq) + 2
    # Padding entries point at real blocks: a kernel that read them would give wrong numbers, not crash.
    block_tables = perm[torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)].int()
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used = 0
    for b, (n, s) in enumerate(zip(blocks_per_seq, seq_lens)):
        block_tables[b, :n] = perm[used:used + n]
        used += n
        pos = torch.arange(s)
        valid[block_tables[b, pos // block_size].long() * block_size + pos % block_size] = True
    k_cache.view(-1, num_kv_heads, head_dim)[~valid] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~valid] = float("nan")
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), to(block_tables), to(qsl), to(lens)


def reference(q, k_cache, v_cache, block_tables, qsl, seq_lens, scale):
    # On the CPU: attention_ref builds its causal positions with a plain torch.arange (CPU tensors).
    args = [t.cpu() for t in (q.float(), k_cache.float(), v_cache.float(), block_tables, qsl, seq_lens)]
    return paged_attention_ref(*args, scale).to(q.device)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_decode(seq_lens, hkv, group, dim, bs, dtype, num_splits=None, max_seq_len=None):
    q, kc, vc, bt, qsl, lens = make_batch(seq_lens, [1] * len(seq_lens), hkv, group, dim, bs, dtype)
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    pa.paged_attention_decode(q, kc, vc, bt, lens, scale, out=out, max_seq_len=max_seq_len, num_splits=num_splits)
    ref = reference(q, kc, vc, bt, qsl, lens, scale)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"decode rel err {err:.2e}"


def check_prefill(seq_lens, q_lens, hkv, group, dim, bs, dtype, **tiles):
    q, kc, vc, bt, qsl, lens = make_batch(seq_lens, q_lens, hkv, group, dim, bs, dtype)
    scale = dim ** -0.5
    out = torch.full_like(q, float("nan"))
    pa.paged_attention_prefill(q, kc, vc, bt, qsl, lens, scale, max(q_lens), out=out, **tiles)
    ref = reference(q, kc, vc, bt, qsl, lens, scale)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"prefill rel err {err:.2e}"


class Meta:
    def __init__(self, slot_mapping, qsl, seq_lens, block_tables, q_lens):
        self.slot_mapping, self.query_start_loc, self.seq_lens, self.block_tables = slot_mapping, qsl, seq_lens, block_tables
        self.max_query_len = max(q_lens)
        self.max_seq_len = int(seq_lens.max())
        self.is_decode_only = all(n == 1 for n in q_lens)


def check_backend(seq_lens, q_lens, hkv, group, dim, bs, dtype):
    """One step through TritonAttentionBackend: this step's K/V go in, attention reads them back."""
    q, kc, vc, bt, qsl, lens = make_batch(seq_lens, q_lens, hkv, group, dim, bs, dtype)
    k = torch.randn(q.shape[0], hkv, dim, device=q.device).to(dtype)
    v = torch.randn_like(k)
    slots = []
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        slots += [int(bt[b, p // bs]) * bs + p % bs for p in range(s - n, s)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=q.device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    meta = Meta(slot_mapping, qsl, lens, bt, q_lens)
    assert isinstance(meta, pa.PagedAttentionMetadata)
    out = pa.TritonAttentionBackend().forward(q, k, v, kc, vc, meta, dim ** -0.5)
    write_kv_ref(k, v, kc_ref, vc_ref, slot_mapping)
    assert torch.equal(kc.nan_to_num(), kc_ref.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())
    ref = reference(q, kc_ref, vc_ref, bt, qsl, lens, dim ** -0.5)
    assert rel_err(out, ref) < TOL[dtype]


def check_write(num_tokens, hkv, dim, bs, dtype, cache_dtype=None, slot_dtype=torch.int64):
    cache_dtype = cache_dtype or dtype
    k = torch.randn(num_tokens, hkv, dim, device=DEVICE).to(dtype)
    v = torch.randn_like(k)
    num_blocks = num_tokens // bs + 2
    slots = torch.randperm(num_blocks * bs)[:num_tokens]
    slots[::3] = -1  # padding tokens are skipped
    slots = slots.to(DEVICE, slot_dtype)
    kc = torch.randn(num_blocks, bs, hkv, dim, device=DEVICE).to(cache_dtype)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    pa.write_kv(k, v, kc, vc, slots)
    write_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# ---- small cases: the interpreter on CPU, compiled on the GPU -------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_small(dtype):
    check_write(13, 2, 80, 8, dtype)


@pytest.mark.parametrize("latent_dim", [64 + 16, 57])  # even, and odd (the v half padded)
def test_write_latent_small(latent_dim):
    """MLA's split latent cache: the Triton write (kv_write.write_latent) equals write_latent_ref."""
    from pagedmoe.kernels.attention_ref import write_latent_ref
    from pagedmoe.kernels.kv_write import write_latent

    D, bs, T = (latent_dim + 1) // 2, 4, 11
    latent = torch.randn(T, latent_dim, device=DEVICE)
    num_blocks = T // bs + 2
    slots = torch.randperm(num_blocks * bs)[:T]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    kc = torch.randn(num_blocks, bs, 1, D, device=DEVICE)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_latent(latent, kc, vc, slots)
    write_latent_ref(latent, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_small(num_splits):
    # Auto: 300 tokens in five 64-token partitions; 3 leaves the shorter sequences' later splits empty.
    check_decode([1, 17, 300], 2, 4, 80, 8, torch.float32, num_splits=num_splits)


def test_decode_small_fp16_mha():
    check_decode([15, 33], 2, 1, 64, 16, torch.float16)


def test_decode_max_seq_len_hint_too_small_is_still_correct():
    check_decode([40, 300], 1, 2, 64, 16, torch.float32, num_splits=2, max_seq_len=64)


def test_prefill_small_mixed():
    # Fresh prefill, a decode row and a chunk over 16 cached positions in one batch.
    check_prefill([5, 15, 33], [5, 1, 17], 2, 2, 64, 16, torch.float32)


def test_prefill_small_chunked_fp16():
    check_prefill([40, 70], [3, 70], 1, 4, 80, 8, torch.float16)


def test_prefill_small_wide_tiles():
    # the tiles large prefills take in half precision (128 rows x 32 keys), over a chunk, a fresh prompt and a
    # decode row: rows of one tile span several tokens' heads and the causal edge cuts through a key tile
    check_prefill([70, 45, 9], [40, 45, 1], 2, 4, 64, 16, torch.float32, block_m=128, block_n=32, num_warps=8)


@pytest.mark.parametrize("lazy", [True, False])
def test_prefill_running_max_jumps_and_creeps(lazy):
    # Scores that grow along the sequence, by less than the lazy rescale's 2^8 a KV tile in one head (the stale
    # max is kept, p grows up to 256) and by far more in another (every tile moves it); fp32 against the reference.
    seq_lens, q_lens = [96, 64], [96, 20]
    q, kc, vc, bt, qsl, lens = make_batch(seq_lens, q_lens, 2, 2, 64, 16, torch.float32, seed=3)
    kv = kc.view(-1, 2, 64)
    for b, n in enumerate(seq_lens):  # key at position p: noise + slope_h * p (slope 0.01 / 0.5 per position)
        pos = torch.arange(n, device=kv.device)
        slots = bt[b, pos // 16].long() * 16 + pos % 16
        kv[slots, 0] = kv[slots, 0] * 0.2 + 0.01 * pos[:, None]
        kv[slots, 1] = kv[slots, 1] * 0.2 + 0.5 * pos[:, None]
    q.abs_()  # q . k then rises with the key's position
    scale = 64 ** -0.5
    out = torch.full_like(q, float("nan"))
    pa.paged_attention_prefill(q, kc, vc, bt, qsl, lens, scale, max(q_lens), out=out, block_m=32, block_n=16,
                               num_warps=4, lazy_rescale=lazy)
    ref = reference(q, kc, vc, bt, qsl, lens, scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float32]


def test_backend_small():
    check_backend([9, 20], [9, 4], 2, 2, 64, 8, torch.float32)
    check_backend([9, 20, 1], [1, 1, 1], 2, 2, 64, 8, torch.float32)


def _bad(name):
    q, kc, vc, bt, qsl, lens = make_batch([5, 9], [1, 1], 2, 2, 64, 8, torch.float32)
    args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=lens)
    if name == "dtype":
        args["q"] = q.half()
    elif name == "heads":
        args["q"] = torch.randn(2, 3, 64, device=q.device)
    elif name == "stride":
        args["q"] = torch.randn(2, 4, 128, device=q.device)[:, :, ::2]
    elif name == "cache_shape":
        args["v_cache"] = vc[:, :, :1]
    elif name == "index_dtype":
        args["seq_lens"] = lens.long()
    elif name == "batch":
        args["seq_lens"] = lens[:1]
    return args


@pytest.mark.parametrize("name", ["dtype", "heads", "stride", "cache_shape", "index_dtype", "batch"])
def test_launchers_reject_bad_arguments(name):
    a = _bad(name)
    with pytest.raises(ValueError):
        pa.paged_attention_decode(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], 0.1)
    qsl = torch.arange(a["seq_lens"].shape[0] + 1, dtype=torch.int32, device=a["q"].device)
    with pytest.raises(ValueError):
        pa.paged_attention_prefill(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], qsl, a["seq_lens"], 0.1, 1)


def test_write_kv_rejects_bad_arguments():
    kc = torch.zeros(4, 8, 2, 64)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        pa.write_kv(k, k, kc, kc, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="k must be"):
        pa.write_kv(torch.zeros(3, 1, 64), torch.zeros(3, 1, 64), kc, kc, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        pa.write_kv(k, k, kc, kc, torch.zeros(3))


def test_choose_num_splits():
    assert pa.choose_num_splits(512, 1024, 132) == 1  # batch fills the GPU
    assert pa.choose_num_splits(8, 1024, 132) == 16  # limited by the minimum partition (64 tokens)
    assert pa.choose_num_splits(128, 1024, 132) == 3
    assert pa.choose_num_splits(8, 32768, 132) == 33
    assert pa.choose_num_splits(1, 1 << 20, 132) == 64  # capped


# ---- GPU grid ---------------------------------------------------------------------------------------

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

DECODE_GRID = [
    # seq_lens, Hkv, G, D, block_size, dtype
    ([1, 15, 17, 33, 100, 1000, 1024, 2047], 8, 4, 128, 16, BF16),  # Mixtral shape
    ([8192], 4, 8, 128, 16, BF16),  # batch 1, long: split-K
    ([32768], 8, 4, 128, 16, BF16),
    ([1, 2, 3, 500, 77], 8, 1, 64, 8, BF16),
    ([15, 17, 300, 1], 2, 4, 80, 32, FP16),
    ([1, 255, 256, 257, 1000], 2, 8, 96, 256, BF16),
    ([33, 100, 1], 2, 4, 256, 16, FP32),
    ([5000, 17], 4, 4, 256, 64, BF16),
    ([100, 15, 4097], 1, 8, 64, 8, FP32),
    ([(i * 37) % 2000 + 1 for i in range(64)], 8, 4, 128, 128, BF16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_GRID, ids=lambda c: f"S{max(c[0])}-B{len(c[0])}-kv{c[1]}-g{c[2]}-d{c[3]}-bs{c[4]}-{str(c[5])[6:]}")
def test_decode_gpu(case):
    seq_lens, hkv, group, dim, bs, dtype = case
    check_decode(seq_lens, hkv, group, dim, bs, dtype, max_seq_len=max(seq_lens))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 7, 64])
def test_decode_gpu_forced_splits(num_splits):
    check_decode([1, 17, 1000, 3000], 8, 4, 128, 16, BF16, num_splits=num_splits)


PREFILL_GRID = [
    # seq_lens, q_lens, Hkv, G, D, block_size, dtype
    ([17, 1, 100, 33, 600], [17, 1, 37, 1, 512], 8, 4, 128, 16, BF16),  # mixed, chunked, decode rows
    ([4096 + 512, 300], [512, 300], 4, 8, 128, 32, BF16),  # 512-token chunk over 4k context
    ([15, 17, 1, 100], [15, 5, 1, 100], 2, 1, 64, 8, FP16),
    ([33, 70], [33, 7], 2, 4, 80, 16, BF16),
    ([129, 64, 1000], [129, 1, 200], 2, 2, 96, 64, BF16),
    ([100, 40], [50, 40], 2, 4, 256, 16, FP32),
    ([700, 1], [300, 1], 4, 4, 256, 256, BF16),
    ([(i * 53) % 900 + 1 for i in range(16)], [1] * 16, 8, 4, 128, 16, BF16),  # all decode rows
    ([4000, 1500, 40], [3500, 1500, 1], 8, 4, 128, 16, BF16),  # >= 1024 programs of 128 rows: the wide default
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILL_GRID, ids=lambda c: f"S{max(c[0])}-Q{max(c[1])}-B{len(c[0])}-kv{c[2]}-g{c[3]}-d{c[4]}-bs{c[5]}-{str(c[6])[6:]}")
def test_prefill_gpu(case):
    check_prefill(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", [(BF16, BF16), (FP32, BF16), (FP16, FP16)])
def test_write_kv_gpu(dtype, cache_dtype):
    check_write(1000, 8, 128, 16, dtype, cache_dtype, slot_dtype=torch.int32)


@pytest.mark.gpu
def test_backend_gpu():
    check_backend([600, 17, 1000], [512, 1, 1], 8, 4, 128, 16, BF16)
    check_backend([600, 17, 1000], [1, 1, 1], 8, 4, 128, 16, BF16)


def _fresh_slots(block_tables, q_lens, block_size):
    """The cache slots of a fresh prefill's tokens (positions 0 .. n - 1 of each sequence), in step order."""
    rows = []
    for b, n in enumerate(q_lens):
        pos = torch.arange(n, device=block_tables.device)
        rows.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn-dense", "flash", "cudnn", "cudnn-gqa"])
def test_fresh_prefill_through_torch_kernels_gpu(kernel):
    """A fresh prefill (every sequence from position 0) through torch's kernels: this step's keys gathered from the
    cache at the slot mapping, then cuDNN (dense, padded here; or varlen) / flash; against the fp32 reference. Sequences of odd lengths,
    GQA 8 (Qwen3-30B-A3B's 32 / 4 heads)."""
    q_lens = [700, 33, 1, 129]
    q, kc, vc, bt, qsl, lens = make_batch(q_lens, q_lens, 4, 8, 128, 16, BF16)
    slots = _fresh_slots(bt, q_lens, kc.shape[1])
    scale = 128 ** -0.5
    # q as the engine has it: the first Hq heads of the fused q/k/v projection's rows (row stride (Hq + 2 Hkv) D)
    qkv = torch.full((q.shape[0], 32 + 2 * 4, 128), float("nan"), dtype=q.dtype, device=q.device)
    qkv[:, :32] = q
    out = pa.fresh_prefill_attention(qkv[:, :32], kc, vc, slots, qsl, max(q_lens), scale, kernel, qsl.cpu())
    err = rel_err(out, reference(q, kc, vc, bt, qsl, lens, scale))
    assert out.shape == q.shape and err < TOL[BF16], f"{kernel}: rel err {err:.2e}"


@pytest.mark.parametrize("q_lens", [[5, 5, 5], [7, 1, 12, 3]], ids=["equal", "padded"])
def test_dense_prefill_layout(q_lens):
    """The cudnn-dense path's layout ([B, S, H, D] views, or sequences right-padded to the longest and gathered
    back) run through SDPA's math backend, against the paged reference: GQA 4, q a slice of wider rows."""
    from torch.nn.attention import SDPBackend

    q, kc, vc, bt, qsl, lens = make_batch(q_lens, q_lens, 2, 4, 16, 4, torch.float32, device="cpu")
    qkv = torch.full((q.shape[0], 8 + 2 * 2, 16), float("nan"))
    qkv[:, :8] = q
    slots = _fresh_slots(bt, q_lens, 4)
    k = kc.view(-1, 2, 16)[slots]
    v = vc.view(-1, 2, 16)[slots]
    out = pa._dense_cudnn(qkv[:, :8], k, v, qsl, 0.25, backend=SDPBackend.MATH)
    ref = reference(q, kc, vc, bt, qsl, lens, 0.25)
    assert out.shape == q.shape and rel_err(out, ref) < TOL[torch.float32]


def test_fresh_kernel_choice(monkeypatch):
    """Which kernel a step's attention takes: auto keeps ours off the GPU (the CPU q here) and for any step that is
    not a fresh prefill with its host query_start_loc; a named kernel is taken for fresh half-precision steps only;
    auto pads to dense only while the padded work stays within DENSE_PADDING_WORK."""
    from types import SimpleNamespace

    qsl = torch.tensor([0, 1024, 2048], dtype=torch.int32)
    meta = SimpleNamespace(fresh=True, query_start_loc_cpu=qsl)
    q, cache = torch.zeros(2048, 4, 128, dtype=BF16), torch.zeros(8, 16, 1, 128, dtype=BF16)
    choose = pa.TritonAttentionBackend.fresh_kernel
    monkeypatch.setattr(pa, "PREFILL_ATTENTION", "auto")
    assert choose(q, cache, meta) is None  # a CPU tensor: no cuDNN
    monkeypatch.setattr(pa, "PREFILL_ATTENTION", "flash")
    assert choose(q, cache, meta) == "flash"
    assert choose(q.float(), cache.float(), meta) is None
    assert choose(q, cache, SimpleNamespace(fresh=False, query_start_loc_cpu=qsl)) is None
    assert choose(q, cache, SimpleNamespace(fresh=True, query_start_loc_cpu=None)) is None   # a graph's metadata
    assert choose(q, cache[:, :8], meta) is None
    monkeypatch.setattr(pa, "PREFILL_ATTENTION", "triton")
    assert choose(q, cache, meta) is None
    assert pa.dense_padding_ok([1024] * 8) and pa.dense_padding_ok([1024, 900])
    assert not pa.dense_padding_ok([64, 31, 40]) and not pa.dense_padding_ok([1024, 16])


@pytest.mark.gpu
def test_auto_picks_cudnn_dense_on_hopper():
    """auto's GPU conditions: a Hopper GPU, bf16, head size 128, equal lengths -> cudnn-dense; head size 96 or
    fp32 -> ours."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("auto takes cudnn-dense on Hopper or later only")
    q = torch.zeros(16, 4, 128, dtype=BF16, device="cuda")
    assert pa.dense_prefill_ok(q, [8, 8])
    assert not pa.dense_prefill_ok(q[..., :96], [8, 8]) and not pa.dense_prefill_ok(q.float(), [8, 8])
