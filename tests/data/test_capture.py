"""Capture correctness on tiny random Llama, Qwen3 and Qwen3-MoE targets against HF output_hidden_states."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from draftsmith.data.capture import capture_aux_hidden_states, length_batches, pad_batch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=1),
}


@pytest.fixture(params=sorted(CONFIGS))
def tiny_target(request):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
    return model.eval()


def _reference(model, ids: list[int]):
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


def test_capture_matches_output_hidden_states(tiny_target):
    seqs = [[5, 9, 11, 3, 7, 8, 2], [4, 4, 10], [1, 2, 3, 4, 5]]
    ids, mask = pad_batch(seqs, pad_id=0)
    aux_ids = [0, 1, 2]  # embeddings, after layer 1, after layer 2 (= pre-final-norm)
    aux, final = capture_aux_hidden_states(tiny_target, ids, mask, aux_ids)
    h = 64
    assert aux.shape == (3, 7, 3 * h) and final.shape == (3, 7, h)
    norm = tiny_target.model.norm
    for b, seq in enumerate(seqs):
        t = len(seq)
        ref = _reference(tiny_target, seq)
        # ids 0 and 1 are HF hidden_states[0], [1]; HF's last entry is after the final norm
        torch.testing.assert_close(aux[b, :t, :h], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(aux[b, :t, h: 2 * h], ref[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[b, :t], ref[2], rtol=1e-4, atol=1e-4)
        # id N is the last layer's output before the norm: normalising it gives the final state
        torch.testing.assert_close(norm(aux[b, :t, 2 * h:]), ref[2], rtol=1e-4, atol=1e-4)


def test_capture_orders_layers_ascending(tiny_target):
    ids, mask = pad_batch([[3, 4, 5, 6]], pad_id=0)
    aux, _ = capture_aux_hidden_states(tiny_target, ids, mask, [1, 2])
    ref = _reference(tiny_target, [3, 4, 5, 6])
    torch.testing.assert_close(aux[0, :, :64], ref[1], rtol=1e-4, atol=1e-4)


def test_length_batches_respects_token_budget():
    lengths = [10, 3, 7, 7, 2, 9]
    batches = length_batches(lengths, max_batch_tokens=20)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 20 or len(b) == 1
