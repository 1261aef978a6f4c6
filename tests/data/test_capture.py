"""Capture correctness on tiny random Llama, Qwen3 and Qwen3-MoE targets against HF output_hidden_states; inputs
go to the input embedding's device, and device_map placement captures the same numbers."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from draftsmith.data.capture import (
    capture_aux_hidden_states,
    capture_to_shards,
    input_device,
    length_batches,
    pad_batch,
)
from draftsmith.data.target import load_target_model

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "tie_word_embeddings": False}
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


class _TowerFirst(torch.nn.Module):
    """A target whose first parameter is not where inputs go (a vision tower, an offloaded part): here on meta."""

    def __init__(self, lm):
        super().__init__()
        self.tower = torch.nn.Linear(2, 2, device="meta")
        self.lm = lm

    def get_decoder(self):
        return self.lm.model


def test_inputs_go_to_the_input_embedding_not_the_first_parameter(tmp_path):
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(CONFIGS["llama"]()).eval()
    wrapped = _TowerFirst(lm)
    assert next(wrapped.parameters()).device.type == "meta" and input_device(wrapped) == torch.device("cpu")
    samples = [{"input_ids": [5, 9, 11, 3], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [4, 4], "loss_mask": [1, 1]}]
    args = (samples, [1, 2], tmp_path / "wrapped", "train", 0, 2, 64, 0, torch.float32)
    got = capture_to_shards(wrapped, *args)
    want = capture_to_shards(lm, samples, [1, 2], tmp_path / "plain", *args[3:])
    assert [e["sha256"] for e in got] == [e["sha256"] for e in want]


@pytest.mark.parametrize("placement", ["auto", "offloaded"])
def test_a_device_map_placed_target_captures_the_same_numbers(tmp_path, placement):
    """target.device_map goes through accelerate's big-model loading; on a CPU-only host "auto" places everything
    on the CPU, and offloading every layer to disk runs them through accelerate's hooks as a split target does."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path / "target")
    plain = load_target_model(str(tmp_path / "target"), "float32")
    if placement == "auto":
        placed = load_target_model(str(tmp_path / "target"), "float32", "auto")
    else:
        placed = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32, device_map="auto",
                                                      max_memory={"cpu": 1000}, offload_folder=str(tmp_path / "off"))
        assert next(placed.parameters()).device.type == "meta" and input_device(placed) == torch.device("cpu")
    ids, mask = pad_batch([[5, 9, 11, 3, 7, 8, 2], [4, 4, 10]], pad_id=0)
    want = capture_aux_hidden_states(plain, ids, mask, [0, 1, 2])
    got = capture_aux_hidden_states(placed, ids.to(input_device(placed)), mask.to(input_device(placed)), [0, 1, 2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
