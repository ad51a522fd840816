"""``kvhal size``: KV bytes per token from a model's config.json (written here: a Llama-like
model with full multi-head attention, a GQA one, an MLA one), and each tier's budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhal import cli
from kvhal.errors import ValidationError
from kvhal.sizing import kv_shape, read_config, size_tiers
from kvhal.tiers.backend import TierSpec
from kvhal.tiers.disk import DiskTier

#: Llama-2-7B's shape: full multi-head attention (no num_key_value_heads), fp16.
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_size": 4096,
    "torch_dtype": "float16",
}
#: Llama-3-8B's: grouped-query attention, 8 KV heads, bf16.
LLAMA3_8B = {**LLAMA2_7B, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}
#: DeepSeek-V3's: multi-head latent attention.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def model_dir(tmp_path: Path, config: dict, name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("config", "per_token"),
    [
        (LLAMA2_7B, 2 * 32 * 32 * 128 * 2),  # 512 KiB: the figure vLLM's docs give Llama-2-7B
        (LLAMA3_8B, 2 * 32 * 8 * 128 * 2),  # 128 KiB
        (DEEPSEEK_V3, 61 * (512 + 64) * 2),  # one latent a layer: 68.6 KiB, not 2 x 128 heads
        ({**LLAMA3_8B, "head_dim": 256}, 2 * 32 * 8 * 256 * 2),  # head_dim given wins over hidden/heads
    ],
)
def test_kv_bytes_per_token(tmp_path, config, per_token):
    shape = kv_shape(read_config(model_dir(tmp_path, config)))
    assert shape.rank_bytes_per_token() == per_token


def test_tensor_parallel_splits_kv_heads_but_not_the_latent():
    gqa, mla = kv_shape(LLAMA3_8B), kv_shape(DEEPSEEK_V3)
    assert gqa.rank_bytes_per_token(4) * 4 == gqa.rank_bytes_per_token()
    # 16 ranks for 8 KV heads: vLLM replicates each head on two ranks
    assert gqa.rank_bytes_per_token(16) == gqa.rank_bytes_per_token(8)
    assert mla.rank_bytes_per_token(8) == mla.rank_bytes_per_token()


def test_the_kv_dtype_and_a_multimodal_text_config():
    assert kv_shape(LLAMA3_8B, "fp8").rank_bytes_per_token() * 2 == kv_shape(LLAMA3_8B).rank_bytes_per_token()
    nested = {"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA3_8B}
    shape = kv_shape(nested)
    assert shape.rank_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert shape.architecture == "LlavaForConditionalGeneration"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_attention_heads": 8}, "num_hidden_layers is None"),
        ({**LLAMA3_8B, "num_hidden_layers": "32"}, "num_hidden_layers is '32'"),
        ({**LLAMA3_8B, "torch_dtype": "int3"}, "'int3' is not a KV dtype"),
        ({**DEEPSEEK_V3, "qk_rope_head_dim": None}, "qk_rope_head_dim is None"),
    ],
)
def test_a_config_it_cannot_read_is_named(config, message):
    with pytest.raises(ValidationError, match=message):
        kv_shape(config)


def test_users_held_by_each_tier():
    shape = kv_shape(LLAMA3_8B)
    blocks, rows = size_tiers(
        shape, tokens_per_user=4100, users=10, given={"host": 64 << 30, "disk": None, "store": 1 << 40}
    )
    assert blocks == 256  # 4100 tokens: 256 full blocks of 16, 4 tokens recomputed
    host, disk, store = rows
    assert host.block_bytes == 2 << 20 and host.budget_for_all == 10 * 256 * (2 << 20)
    assert host.users_held == 128
    assert disk.block_bytes == (2 << 20) + 64 and disk.users_held is None  # a record per slot
    assert store.block_bytes == (2 << 20) + 96
    assert store.users_held == (1 << 40) // store.block_bytes // 256


def test_the_disk_budget_holds_the_blocks_the_disk_tier_makes(tmp_path):
    """The sizes come from the disk tier's own geometry: a slot that is no multiple of 4 KiB
    takes a rounded-up stride, and a real DiskTier of that budget has as many slots per rank."""
    small = {**LLAMA3_8B, "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 80}
    shape = kv_shape(small)
    budget, tp = 50 << 20, 2
    _, rows = size_tiers(shape, tensor_parallel=tp, tokens_per_user=64, users=1, given={"disk": budget})
    disk = next(r for r in rows if r.tier == "disk")
    slot = 16 * shape.rank_bytes_per_token(tp)
    assert slot % 4096  # the rounding is exercised
    tier = DiskTier(TierSpec({"path": str(tmp_path / "d"), "bytes_to_use": budget}, slot, {}, "io", 0, tp))
    assert disk.blocks_held == tier.num_slots
    tier.close()


def test_the_command_prints_each_tier(tmp_path, capsys):
    folder = model_dir(tmp_path, LLAMA3_8B)
    assert cli.main(["size", str(folder), "--users", "64", "--host", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV per token: 131072 bytes (128.00 KiB)" in out
    assert "one user's context of 4096 tokens: 256 full blocks, 512.00 MiB" in out
    lines = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["host"], ["disk"], ["store"])
    }
    assert set(lines) == {"host", "disk", "store"}
    assert lines["host"][-1] == "128" and "32.00" in lines["host"]  # 64 users need 32 GiB; 64 GiB holds 128
    assert cli.main(["size", str(folder / "config.json"), "--tp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_per_token"] == 131072 and report["blocks_per_user"] == 256


def test_the_command_names_a_missing_config(tmp_path, capsys):
    assert cli.main(["size", str(tmp_path)]) == 1
    assert "config.json does not exist" in capsys.readouterr().out
