"""Record a kept worker trace of a geometry ``kvhal bench chat`` does not build: a small chat
on the end-to-end tests' models, in a real vLLM engine with ``KVHAL_TRACE_DIR`` set, each
worker's trace moved to its fixed name in the kept traces' folder.

    .venv/bin/python scripts/traces/record.py chat-hybrid      # HYBRID_MODEL: two KV cache groups
    .venv/bin/python scripts/traces/record.py chat-tp2         # TP=2: chat-tp2-rank0, chat-tp2-rank1
    .venv/bin/python scripts/traces/record.py chat-mla         # MLA (a tiny DeepSeek-V2)

``scripts/record-traces.sh`` runs these with the rest. The workload is small on purpose (a few
users and rounds, a device cache a third of the conversations, so returning users load from
kvhal): each trace stays well under 300 KB.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvhal.bench.chat.workload import workload
from kvhal.testing.models import HYBRID_MODEL, TEST_MODEL
from kvhal.testing.scenario import run_scenario
from kvhal_conformance.traces import HERE

MODELS = Path.home() / ".cache" / "kvhal-test-models"
#: 8 users of 160-256 tokens, 3 rounds of a 32-token turn and 16 generated tokens: at most 416
#: tokens a conversation (max_model_len 512), about 95 blocks of 32 tokens in all
WORK = {"users": 8, "rounds": 3, "context": (160, 256), "turn": 32, "seed": 40}
#: a block of 32 tokens of TEST_MODEL (2 layers x 2 KV heads x 32 x 2 x 32 x bf16) is 16 KiB: 36
#: blocks on the device, half of the conversations' (two requests in flight at their longest fit)
DEVICE_BYTES = 36 * (16 << 10)
KVHAL = {"cpu_bytes_to_use": 16 << 20, "offload_prompt_only": False}


@dataclass(frozen=True)
class TinyDeepseekV2:
    """A DeepSeek-V2 architecture (MLA) at the only latent size vLLM's CPU MLA decode kernel
    takes (kv_lora_rank 512 + rope 64 = 576), dense MLP in every layer, random weights."""

    vocab_size: int = 1024
    layers: int = 2

    def build(self, root: Path) -> Path:
        folder = Path(root) / f"tiny-deepseek-v2-mla-{self.layers}"
        if (folder / "model.safetensors").exists():
            return folder
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            vocab_size=self.vocab_size,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=self.layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=self.layers,  # no MoE layer
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
        generator = torch.Generator().manual_seed(0)
        model = DeepseekV2ForCausalLM(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        tmp = folder.with_name(folder.name + ".tmp")
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tmp.rename(folder)
        return folder


#: trace name -> (model, engine overrides, environment, the ranks that write a trace)
TRACES = {
    # vLLM's hybrid allocator: one pool, two groups (sliding window, full attention)
    "chat-hybrid": (HYBRID_MODEL, {"kv_cache_memory_bytes": DEVICE_BYTES}, {}, (0,)),
    # each worker holds one of the two KV heads: half of every block, half the bytes
    "chat-tp2": (
        TEST_MODEL,
        {
            "kv_cache_memory_bytes": DEVICE_BYTES // 2,  # per worker
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "mp",
        },
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per worker (../shared/docs/vllm-cpu.md)
        (0, 1),
    ),
    # MLA: one latent [B, 1, N, 576] a layer; vLLM's CPU platform forces block_size 16 and turns
    # its own prefix cache off for MLA (kvhal alone serves returning users)
    "chat-mla": (TinyDeepseekV2(), {"kv_cache_memory_bytes": 1152 * 2 * 1024, "block_size": 16}, {}, (0,)),
}


def record(name: str, out: Path = HERE) -> list[Path]:
    """Run ``name``'s chat with the recorder on; the kept files it wrote (one per rank)."""
    recipe, engine, env, ranks = TRACES[name]
    work = workload(
        WORK["users"], WORK["rounds"], WORK["context"], WORK["turn"], recipe.vocab_size, WORK["seed"]
    )
    chat = {
        "op": "chat",
        "tag": name,
        "histories": work["contexts"],
        "users": list(range(len(work["contexts"]))),
        "turns": work["turns"],
        "max_tokens": 16,
        "inflight": 2,
        "logprobs": 0,
        "metrics": False,
    }
    with tempfile.TemporaryDirectory(prefix="kvhal-record-") as where:
        result = run_scenario(
            {
                "model": str(recipe.build(MODELS)),
                "kvhal": KVHAL,
                "steps": [chat],
                "engine": engine,
                "env": {**env, "KVHAL_TRACE_DIR": where},
            },
            timeout=900,
        )
        written = {int(p.name.split("-rank")[1].split(".")[0]): p for p in Path(where).glob("*.json.gz")}
        if sorted(written) != list(ranks):
            raise SystemExit(f"{name}: expected a trace of ranks {list(ranks)}, found {sorted(written)}")
        kept = []
        for rank, path in sorted(written.items()):
            target = out / (f"{name}-rank{rank}.json.gz" if len(ranks) > 1 else f"{name}.json.gz")
            shutil.copyfile(path, target)
            kept.append(target)
    loaded = sum(q["kvhal_loaded_tokens"] or 0 for r in result["steps"][0]["rounds"] for q in r["requests"])
    for path in kept:
        print(f"{path}: {path.stat().st_size} bytes ({loaded} tokens loaded from kvhal)")
    return kept


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="+", choices=sorted(TRACES))
    parser.add_argument("--out", type=Path, default=HERE, help="folder (default: the kept traces')")
    args = parser.parse_args()
    for name in args.names:
        record(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
