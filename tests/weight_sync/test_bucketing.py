"""The flat-buffer rule shared by sender and receiver, bucket boundaries, dtype names, transport choice."""

import pytest
import torch

from asyncrl.weight_sync import WeightSyncError, resolve_transport
from asyncrl.weight_sync.bucketing import (
    TensorMeta,
    dtype_name,
    flat_groups,
    iter_buckets,
    metas_from_request,
    metas_of,
    pack,
    parse_dtype,
    unpack,
)
from asyncrl.weight_sync.receiver import check_metas


def test_flat_groups_follow_first_appearance_of_each_dtype():
    metas = [TensorMeta("a", "bfloat16", (2,)), TensorMeta("b", "float32", (3,)),
             TensorMeta("c", "bfloat16", (1, 2)), TensorMeta("d", "float32", ())]
    assert flat_groups(metas) == [("bfloat16", [0, 2]), ("float32", [1, 3])]


def test_pack_then_unpack_gives_back_every_tensor_exactly():
    ts = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor([7, 8], dtype=torch.int64),
          torch.tensor(9.5), torch.tensor([[1.5], [2.5]], dtype=torch.float32)]
    named = [(f"t{i}", t) for i, t in enumerate(ts)]
    metas = metas_of(named)
    out: list = [None] * 4
    for dtype, idx in flat_groups(metas):
        flat = pack(ts, idx)
        assert flat.dtype == parse_dtype(dtype) and flat.dim() == 1
        for i, v in zip(idx, unpack(flat.clone(), metas, idx)):
            out[i] = v
    # float32 group: 6 + 1 + 2 elements in names order
    assert pack(ts, [0, 2, 3]).tolist() == [0, 1, 2, 3, 4, 5, 9.5, 1.5, 2.5]
    for a, b in zip(ts, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_unpack_rejects_a_buffer_of_the_wrong_length():
    metas = [TensorMeta("x", "float32", (2, 2))]
    with pytest.raises(ValueError, match="holds 5 elements, the metas need 4"):
        unpack(torch.zeros(5), metas, [0])


def test_buckets_respect_the_byte_budget_and_keep_order():
    # sizes in bytes (float32): 40, 40, 40, 200, 8
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(10)),
             ("big", torch.zeros(50)), ("d", torch.zeros(2))]
    got = [[n for n, _ in b] for b in iter_buckets(named, 100)]
    assert got == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [[n for n, _ in b] for b in iter_buckets(named, 10_000)] == [["a", "b", "c", "big", "d"]]
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        list(iter_buckets(named, 0))


def test_dtype_names_match_sglang_spelling():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert parse_dtype("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="weight 'w': unknown dtype 'float8'"):
        parse_dtype("float8", "weight 'w'")
    with pytest.raises(ValueError, match="lengths 2/1/2"):
        metas_from_request(["a", "b"], ["float32"], [[1], [2]])


def test_check_metas_names_the_bad_tensor():
    targets = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    assert check_metas(targets, [TensorMeta("w", "float32", (2, 3))]) is None
    assert "'nope' is not a tensor" in check_metas(targets, [TensorMeta("nope", "float32", (3,))])
    assert check_metas(targets, [TensorMeta("b", "float32", (4,))]) == "weight 'b': sender shape [4] != engine shape [3]"
    assert check_metas(targets, [TensorMeta("b", "bfloat16", (3,))]) is None  # floating: converted when applied
    assert check_metas(targets, [TensorMeta("b", "int64", (3,))]) == "weight 'b': sender dtype int64 != engine dtype float32"


@pytest.mark.parametrize("requested,cuda,colocated,want", [
    ("auto", False, False, "gloo"), ("auto", True, False, "nccl"), ("auto", True, True, "tensor"),
    ("disk", True, True, "disk"), ("gloo", True, False, "gloo"),
])
def test_transport_follows_placement_unless_overridden(requested, cuda, colocated, want):
    assert resolve_transport(requested, cuda, colocated) == want


def test_unknown_transport_is_rejected_by_name():
    with pytest.raises(WeightSyncError, match="transport='ib'") as err:
        resolve_transport("ib", False, False)
    assert err.value.code == "config"


def test_bucket_budget_is_checked_when_asked_not_at_the_first_bucket():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0, got 0"):
        iter_buckets(iter([]), 0)


def test_the_served_dtype_is_used_only_when_every_engine_names_the_same_known_one():
    from asyncrl.weight_sync.broadcast import _served_dtype
    from asyncrl.weight_sync.bucketing import is_float_dtype

    def ours(**kw):
        return {"asyncrl": True, **kw}

    assert _served_dtype([ours(dtype="bfloat16"), ours(dtype="bfloat16")], [{}, {}]) == torch.bfloat16
    # an embedded engine says it in /weight_sync_info, SGLang's /server_info dtype tells it ({}: not ours)
    assert _served_dtype([ours(dtype="bfloat16"), {}], [{}, {"dtype": "bfloat16"}]) == torch.bfloat16
    for exts, infos in (([ours(dtype="bfloat16"), ours(dtype="float32")], [{}, {}]),  # engines disagree
                        ([ours(dtype="bfloat16"), ours()], [{}, {}]),                 # one does not say
                        ([ours(dtype="float8_e9")], [{}]),                            # unknown name
                        ([ours(dtype=["bfloat16"])], [{}]), ([ours(dtype=None)], [{}]), ([], []),
                        ([{}], [{"dtype": "auto"}]),                                  # SGLang's auto, no config
                        ([ours(dtype="bfloat16"), {}], [{}, {"dtype": "float16"}])):
        assert _served_dtype(exts, infos) is None, (exts, infos)
    assert is_float_dtype("bfloat16") and is_float_dtype("torch.float16")
    assert not is_float_dtype("int64") and not is_float_dtype("bool") and not is_float_dtype("float8_e9")
