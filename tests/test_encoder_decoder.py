"""Encoder-decoder models from Hugging Face configs (issue 39, item 1): the default units are the
encoder's blocks and the decoder's, so a budget that only checkpointing both reaches is planned,
and the plan's measured peak is its prediction."""

import copy

import pytest
import torch

import memfit
from memfit.units import find_units, summary

transformers = pytest.importorskip("transformers")


def whisper():
    config = transformers.WhisperConfig(
        encoder_layers=3, decoder_layers=3, d_model=64, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=96, num_mel_bins=16, max_source_positions=64,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    labels = torch.randint(3, 96, (2, 16))
    return transformers.WhisperForConditionalGeneration(config), {
        "input_features": torch.randn(2, 16, 128), "labels": labels}


def bart():
    config = transformers.BartConfig(encoder_layers=3, decoder_layers=3, d_model=64, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                     vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config), {
        "input_ids": torch.randint(3, 96, (2, 48)), "labels": torch.randint(3, 96, (2, 16))}


def t5():
    config = transformers.T5Config(num_layers=3, num_decoder_layers=3, d_model=64, d_ff=128, num_heads=2, d_kv=32,
                                   vocab_size=96, decoder_start_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config), {
        "input_ids": torch.randint(3, 96, (2, 48)), "labels": torch.randint(3, 96, (2, 16))}


@pytest.mark.parametrize("factory", [whisper, bart, t5], ids=["whisper", "bart", "t5"])
def test_default_units_take_the_encoder_and_the_decoder(factory):
    model, inputs = factory()
    units = find_units(model, "auto")
    assert any(".encoder." in f".{u}" for u in units) and any(".decoder." in f".{u}" for u in units)
    said = summary(units)  # what the command line prints: both stacks, each as one range
    assert said.count(" (") == 2 and "encoder." in said and "decoder." in said, said
    decoder_only = [u for u in units if ".decoder." in f".{u}"]
    both = memfit.profile(copy.deepcopy(model), inputs, repeat=1)
    alone = memfit.profile(copy.deepcopy(model), inputs, units=decoder_only, repeat=1)
    reach_both, reach_alone = memfit.min_budget_bytes(both), memfit.min_budget_bytes(alone)
    assert reach_both < reach_alone
    budget = (reach_both + reach_alone) // 2
    with pytest.raises(memfit.InfeasibleBudgetError):
        memfit.plan(alone, budget)
    sched = memfit.plan(both, budget)
    assert any(".encoder." in f".{u}" for u in sched.checkpointed)
    check = memfit.validate(copy.deepcopy(model), inputs, sched, steps=0)
    # the decoder's cross-attention keeps the encoder's output: predicted to the byte or, where
    # the memory model books a shared output cautiously, a little above, never below
    assert 0 <= check.predicted_peak_bytes - check.measured_peak_bytes <= 0.01 * check.measured_peak_bytes
    assert check.predicted_peak_bytes <= budget
