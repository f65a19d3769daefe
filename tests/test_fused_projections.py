"""The replica's fused q/k/v and gate/up projections (rlbus.rollout.engines.fused_projections): the same model
under the same names, fewer matrix products, and a weight push that copies in place still reaches them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rlbus.modeling import load_causal_lm
from rlbus.rollout.engines.fused_projections import fuse_projections
from rlbus.tiny_model import build_random_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, _ = build_random_qwen2(
        tmp_path_factory.mktemp("qwen2"), 128, 2, kv_heads=2, intermediate=256, max_positions=256
    )
    return out


def load(model_dir: Path) -> nn.Module:
    return load_causal_lm(
        model_dir, dtype="float32", device=torch.device("cpu"), trainable=False, attn_implementation="sdpa"
    )


def linear_calls(model: nn.Module, ids: torch.Tensor) -> int:
    """Matrix products in the model's traced graph (dynamo, no compiler)."""
    seen = {}

    def count(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen["n"] = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=count, fullgraph=True)(ids)
    return seen["n"]


def test_fused_model_is_the_same_model_with_fewer_products(model_dir: Path) -> None:
    plain, fused = load(model_dir), load(model_dir)
    assert fuse_projections(fused) == 4  # q/k/v and gate/up in each of 2 layers
    assert plain.state_dict().keys() == fused.state_dict().keys()
    assert all(torch.equal(v, fused.state_dict()[k]) for k, v in plain.state_dict().items())
    ids = torch.randint(3, 50, (4, 12))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, fused(ids).logits)
        compiled = torch.compile(fused, fullgraph=True)
        assert torch.allclose(compiled(ids).logits, plain(ids).logits, atol=1e-5)
    assert (linear_calls(plain, ids), linear_calls(fused, ids)) == (2 * 7 + 1, 2 * 4 + 1)


def test_a_push_copied_in_place_reaches_the_fused_product(model_dir: Path) -> None:
    plain, fused = load(model_dir), load(model_dir)
    fuse_projections(fused)
    generator = torch.Generator().manual_seed(0)
    pushed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in plain.state_dict().items()}
    with torch.no_grad():
        for model in (plain, fused):
            state = model.state_dict()
            for name, value in pushed.items():
                state[name].copy_(value)
        ids = torch.randint(3, 50, (2, 9))
        assert torch.equal(plain(ids).logits, fused(ids).logits)


def test_a_follower_called_on_its_own_computes_its_own_product(model_dir: Path) -> None:
    fused = load(model_dir)
    fuse_projections(fused)
    attn = fused.model.layers[0].self_attn
    x = torch.randn(3, 128)
    with torch.no_grad():
        alone = attn.v_proj(x)  # no q_proj call before it
        assert torch.allclose(alone, x @ attn.v_proj.weight.T + attn.v_proj.bias, atol=1e-6)
        attn.q_proj(x)
        other = torch.randn(3, 128)
        own_k = other @ attn.k_proj.weight.T + attn.k_proj.bias
        assert torch.allclose(attn.k_proj(other), own_k, atol=1e-6)  # other's product, not x's
        own_v = x @ attn.v_proj.weight.T + attn.v_proj.bias
        assert torch.allclose(attn.v_proj(x), own_v, atol=1e-6)  # its own part of x's, not k's


def test_forwards_on_two_threads_each_get_their_own_products(model_dir: Path) -> None:
    """A model run on two threads at once (a compile of the decode step beside the batches would be one): each
    thread's k and v are its own input's, however their calls interleave."""
    import sys
    import threading

    fused = load(model_dir)
    fuse_projections(fused)
    attn = fused.model.layers[0].self_attn
    wrong: list[object] = []  # a product of the other thread's input, or what a follower raised

    def project(rows: int) -> None:
        x = torch.randn(rows, 128)
        want = [x @ m.weight.T + m.bias for m in (attn.k_proj, attn.v_proj)]
        with torch.no_grad():
            for _ in range(2000):
                try:
                    attn.q_proj(x)
                    got = [attn.k_proj(x), attn.v_proj(x)]
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    wrong.append(exc)
                    continue
                wrong.extend(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.shape != w.shape)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=project, args=(rows,)) for rows in (3, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong
