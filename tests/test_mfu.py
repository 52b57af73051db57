"""fsdp_guide.mfu against published figures, and against torch's own FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.mfu import flops_per_token, matmul_parameters, mfu, peak_flops


def _llama_3_1_8b():
    """Llama 3.1 8B's architecture (its config.json on the Hub), built on the meta device: shapes, no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_torchtitans_published_llama_3_1_8b_mfu_is_reproduced_from_its_throughput():
    # torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (at commit 820504e): Llama 3.1 8B,
    # FSDP on 8 and on 128 H100s, bf16, selective activation checkpointing; tokens per second
    # per GPU in its Tables 1 and 3. The sequence length, 8192, is seq_len in
    # train_configs/llama3_8b.toml at the torchtitan commit the benchmark names (9dec370).
    tps_per_gpu = {"8 GPUs": 5_762, "8 GPUs, compiled": 6_667, "128 GPUs": 5_605, "128 GPUs, compiled": 6_514}
    # The text above its tables: these four runs "achieve 33% to 39% MFU", with the H100 SXM's
    # peak (its footnote 2 says so, without the number; get_peak_flops at 9dec370 returns 989e12).
    model = _llama_3_1_8b()
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # "8B"
    per_token = flops_per_token(model, n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
    utilisation = {run: mfu(tps, per_token, "NVIDIA H100 80GB HBM3") for run, tps in tps_per_gpu.items()}
    assert (round(100 * min(utilisation.values())), round(100 * max(utilisation.values()))) == (33, 39)


def test_the_formula_counts_what_torchs_flop_counter_counts_in_a_forward_and_backward():
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    # The math kernel: its matmuls are ones the counter sees (it has no formula for the CPU's fused kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    counted = counter.get_total_flops() / tokens[:, 1:].numel()
    head_dim = config.n_embd // config.n_head
    # Attention at the mean causal length would be half: torch counts the whole T x T, as the formula does.
    expected = flops_per_token(model, n_layers=2, n_heads=4, head_dim=head_dim, seq_len=config.block_size - 1)
    assert counted == pytest.approx(expected, rel=0.02)
    # The tied output head is a matmul; the position embedding, a lookup, is not.
    assert matmul_parameters(model) == sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()


def test_the_three_classic_mistakes_each_give_another_number():
    model = _llama_3_1_8b()
    right = mfu(6_000, flops_per_token(model, n_layers=32, n_heads=32, head_dim=128, seq_len=8192), 989e12)
    sparse_peak = mfu(6_000, flops_per_token(model, n_layers=32, n_heads=32, head_dim=128, seq_len=8192), 1979e12)
    a_ranks_shard = mfu(
        6_000,
        flops_per_token(matmul_parameters(model) // 8, n_layers=32, n_heads=32, head_dim=128, seq_len=8192),
        989e12,
    )
    no_attention = mfu(6_000, 6 * matmul_parameters(model), 989e12)
    assert sparse_peak == pytest.approx(right / 2, rel=0.01)
    assert a_ranks_shard < right / 3 and no_attention < right * 0.8


def test_a_peak_it_does_not_know_and_impossible_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="dense .without sparsity."):
        peak_flops("Radeon 9000")
    assert peak_flops("NVIDIA H100 NVL") == 835e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    with pytest.raises(ValueError, match="'NVIDIA H100 CNX'"):  # a variant the table does not name
        peak_flops("NVIDIA H100 CNX")
    with pytest.raises(ValueError, match="at least one device"):
        mfu(1_000, 10**9, 989e12, devices=0)


def _flops_per_token_sharded_and_whole():
    from fsdp_guide import device
    from fsdp_guide.recipes.train_llm import TrainConfig, shard_model

    config = TrainConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    sharded = shard_model(config, device(), torch.float32)  # each rank holds half of each parameter
    whole = GPT(config.model_config())
    return [flops_per_token(model, n_layers=2, n_heads=4, head_dim=16, seq_len=64) for model in (sharded, whole)]


def test_a_sharded_model_counts_its_whole_parameters_once_with_the_tied_head():
    from fsdp_guide import launch

    for sharded, whole in launch(_flops_per_token_sharded_and_whole, world_size=2, output="none"):
        assert sharded == whole


# The names torch.cuda.get_device_name() gives, and half the sparse figure of each part's datasheet
# (mfu.PEAK_BF16_DENSE cites each): the NVL parts have a lower peak than the SXM ones they share a die with.
@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA B200", 2250),
    ],
)
def test_each_part_gets_its_own_datasheet_peak(name, tflops):
    assert peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA GH200 480GB",
        "NVIDIA H800",
        "NVIDIA H100 CNX",
        "NVIDIA H200 NVX",
        "NVIDIA H200 PCIe",
        "NVIDIA A100X",
        "NVIDIA B200A",
    ],
)
def test_a_variant_never_falls_through_to_another_parts_peak(name):
    with pytest.raises(ValueError, match="no dense bf16 peak known"):
        peak_flops(name)
