"""The DeepEP dispatcher: on CPU, the choices it makes before any kernel (mode per round, the
low-latency call's arguments for the deep_ep at hand, the errors); on a GPU with deep_ep built
(scripts/build_deep_ep.sh), a one-rank round trip through both modes against what one rank must get back."""

from __future__ import annotations

import importlib.util
import inspect
import tempfile

import pytest
import torch

from libs.ep.comm import InProcessHub, TorchComm
from libs.ep.dispatch.deepep import DeepEPDispatcher, deepep_api, ll_dispatch_options, pick_mode
from libs.ep.dispatch.factory import make_dispatcher

HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


def test_rounds_that_fit_take_low_latency_larger_ones_normal() -> None:
    assert pick_mode(128, 128, has_normal=True, has_ll=True) == "low_latency"
    assert pick_mode(129, 128, has_normal=True, has_ll=True) == "normal"
    assert pick_mode(1, 128, has_normal=True, has_ll=False) == "normal"
    assert pick_mode(1, 128, has_normal=False, has_ll=True) == "low_latency"
    with pytest.raises(RuntimeError, match="exceed DeepEP low-latency's 128.*mode='auto'"):
        pick_mode(129, 128, has_normal=False, has_ll=True)


def test_low_latency_arguments_follow_the_installed_signature() -> None:
    # DeepEP 1.0.0 (PyPI's sdist): no use_fp8, always FP8 out
    def v100(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, async_finish=False, return_recv_hook=False
    ):  # noqa: ANN001, ANN202
        ...

    def later(x, topk_idx, num_max, num_experts, cumulative_local_expert_recv_stats=None, use_fp8=True):  # noqa: ANN001, ANN202
        ...

    assert ll_dispatch_options(inspect.signature(v100).parameters, fp8=False) == ({}, True)
    assert ll_dispatch_options(inspect.signature(later).parameters, fp8=False) == ({"use_fp8": False}, False)
    assert ll_dispatch_options(inspect.signature(later).parameters, fp8=True) == ({"use_fp8": True}, True)


@pytest.mark.skipif(HAS_DEEP_EP, reason="deep_ep is installed here")
def test_missing_deep_ep_is_named_with_the_build_script() -> None:
    comm = InProcessHub(1).comm(0)
    with pytest.raises(RuntimeError, match=r"deep_ep.*scripts/build_deep_ep.sh"):
        make_dispatcher("deepep", comm, slots_per_rank=16, num_physical=16, hidden=256, dtype=torch.bfloat16)


def test_bad_arguments_fail_before_deep_ep_is_needed() -> None:
    comm = InProcessHub(1).comm(0)
    with pytest.raises(ValueError, match="mode must be one of"):
        DeepEPDispatcher(None, comm, 16, 256, torch.bfloat16, mode="fast")
    with pytest.raises(ValueError, match="multiple of 128"):
        DeepEPDispatcher(None, comm, 16, 200, torch.bfloat16, fp8=True)


# --- GPU: the real Buffer at world 1 ---

T, D, E, K = 64, 7168, 32, 8


@pytest.fixture(scope="module")
def world1():  # noqa: ANN201
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = tempfile.mkdtemp(prefix="deepep-test-")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_DEEP_EP, reason="needs CUDA and deep_ep")
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("fp8", [True, False])
def test_one_rank_round_trip(world1, mode: str, fp8: bool) -> None:  # noqa: ANN001
    """Identity experts: what comes back is each token times the sum of its top-k weights (V1 Buffer or
    V2 EPBuffer, whichever deep_ep is installed)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda", generator=g)
    disp = make_dispatcher(
        "deepep", TorchComm(world1, "cuda"), slots_per_rank=E, num_physical=E, hidden=D, dtype=torch.bfloat16,
        fp8=fp8, group=world1, mode=mode,
    )  # fmt: skip
    d = disp.dispatch(x, slots, w)
    v1_ll = mode == "low_latency" and deepep_api() == "v1"  # DeepEP V2 has one (token-layout) dispatch
    assert d is not None and d.layout == ("experts" if v1_ll else "tokens")
    if d.layout == "tokens":  # [M, D] rows with local ids and weights: experts return the weighted sum
        assert d.local_ids is not None and d.weights is not None
        y = d.x * torch.where(d.local_ids >= 0, d.weights, 0.0).sum(1, keepdim=True).to(d.x.dtype)
    else:  # [S, cap, D] per local expert: experts return rows unweighted, combine weighs them
        assert d.counts == torch.bincount(slots.flatten(), minlength=E).tolist()
        y = d.x
    out = disp.combine(y, d)
    want = x.float() * w.sum(1, keepdim=True)
    tol = 0.15 if (fp8 or mode == "low_latency") else 0.05  # FP8 rows, then a bf16 combine
    torch.testing.assert_close(out.float(), want, atol=tol * want.abs().max().item(), rtol=0.1)
