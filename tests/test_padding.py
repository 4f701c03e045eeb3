"""Key padding read once per forward pass, and read again after a change PyTorch does not track (an alias)."""

import pytest
import torch
import torch.nn.functional as F

import sparse_compile
from sparse_compile import SparseConfig

from helpers import SMALL, compile_small, random_qkv

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def _two_layers_with_padding(q, k, v, pad):
    n = q.shape[-2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask = (j <= i)[None, None] & (pad != 0)[:, None, None, :]
    h = torch.tanh(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return F.scaled_dot_product_attention(h, k, v, attn_mask=mask)


@pytest.mark.parametrize("alias", ["numpy", "data"])
def test_padding_mask_changed_through_an_alias_is_read_again_once_per_forward(alias, monkeypatch):
    from sparse_compile import padding

    reads = []
    real = padding.compute_layout
    monkeypatch.setattr(padding, "compute_layout", lambda m: reads.append(1) or real(m))
    q, k, v = random_qkv(2, 2, 2, 40, 40, 16)
    pad = torch.ones(2, 40, dtype=torch.long)
    compiled = compile_small(_two_layers_with_padding, method="pbs")
    with torch.no_grad():
        compiled(q, k, v, pad)
        assert len(reads) == 1  # two layers, one read
        version = pad._version
        if alias == "numpy":
            pad.numpy()[0, :9] = 0
        else:
            pad.data[0, :9] = 0
        assert pad._version == version  # PyTorch did not see the change
        out = compiled(q, k, v, pad)
        ref = _two_layers_with_padding(q, k, v, pad)
    assert len(reads) == 2
    assert "padded batch" in sparse_compile.runtime_stats()["<scaled_dot_product_attention>"].last_reason
    valid = pad.bool()  # padded query rows are undefined in both
    torch.testing.assert_close(out.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-4, atol=1e-5)


def test_transformers_front_door_reads_a_padding_mask_once_per_forward_and_again_after_an_alias_change(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from sparse_compile import padding
    from sparse_compile import transformers_attention as front

    if not front.supports_version(transformers.__version__):
        pytest.skip("transformers without AttentionMaskInterface")
    reads = []
    real = padding.compute_layout
    monkeypatch.setattr(padding, "compute_layout", lambda m: reads.append(1) or real(m))
    config = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=256, intermediate_size=64,
                                      num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 128, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        sparse_compile.enable_transformers_attention(model, SparseConfig(**SMALL).keep_all())
        model(ids, attention_mask=mask)
        assert len(reads) == 1  # two layers, one read
        mask.numpy()[0, :9] = False  # unseen by PyTorch's version counter
        out = model(ids, attention_mask=mask).logits
        assert len(reads) == 2
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[mask], ref[mask], rtol=1e-4, atol=1e-4)
