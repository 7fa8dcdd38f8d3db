"""Models built by the user's own factory, as a user writes it, estimated for a GPU not at hand:
their weight initialisers run on fake tensors (issue 39: ``trunc_normal_`` redraws until every
value is in range, which fake tensors refuse)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from memfit.policy import FULL, KEEP
from memfit.profiler.estimate import estimate

transformers = pytest.importorskip("transformers")


def vit():
    config = transformers.ViTConfig(image_size=64, patch_size=16, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=128, num_labels=10)
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 64, 64),
                                                            "labels": torch.zeros(2, dtype=torch.long)}


def swin():
    config = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                     window_size=4, num_labels=10)
    return transformers.SwinForImageClassification(config), {"pixel_values": torch.randn(2, 3, 64, 64),
                                                             "labels": torch.zeros(2, dtype=torch.long)}


def convnext():
    config = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10,
                                         image_size=64)
    return transformers.ConvNextForImageClassification(config), {"pixel_values": torch.randn(2, 3, 64, 64),
                                                                 "labels": torch.zeros(2, dtype=torch.long)}


@pytest.mark.parametrize("factory", [vit, swin, convnext], ids=["vit", "swin", "convnext"])
def test_hugging_face_vision_factories_estimate_for_a_gpu(factory):
    prof = estimate(factory, target="a100-40gb")
    assert len(prof.unit_names) >= 2
    assert all(u.options[FULL].stored_bytes < u.options[KEEP].stored_bytes for u in prof.units)
    # and the initialisers are the real ones again: a model built now has drawn weights
    model, _ = factory()
    weights = torch.cat([p.detach().flatten() for p in model.parameters() if p.dim() > 1])
    assert weights.std() > 0


def test_initialisers_taken_by_a_library_imported_during_the_build_are_put_back():
    """transformers keeps references to torch's initialisers, taken when it is first imported; a
    factory that imports it while memfit has them as no-ops must not leave them so."""
    code = textwrap.dedent("""
        import torch
        from memfit.profiler.estimate import estimate

        def build():
            import transformers
            config = transformers.ViTConfig(image_size=32, patch_size=16, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=64, num_labels=2)
            return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(1, 3, 32, 32)}

        estimate(build, target="h100")
        import transformers.initialization as init
        assert all(getattr(f, "__name__", "") != "untouched" for f in init.TORCH_INIT_FUNCTIONS.values())
        model, _ = build()
        print(float(model.vit.embeddings.position_embeddings.detach().std()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 0.01 < float(out.stdout.strip().splitlines()[-1]) < 0.03  # trunc_normal_(std=0.02) drew them
