"""Small random Llama-architecture models, built locally (no model hub is reachable).

Used by the end-to-end tests, the demo and ``kvhal bench e2e``. Weights are
redrawn from N(0, std) so greedy decoding is not degenerate, cast to bf16 and
saved as safetensors; ``layer_types`` makes a hybrid model (sliding-window and
full-attention layers, two KV cache groups in vLLM).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    """A model recipe; :meth:`build` writes it once per distinct recipe."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    std: float = 0.1
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        recipe = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(recipe.encode()).hexdigest()[:12]

    def build(self, root: Path) -> Path:
        """Write the model under ``root/<tag>`` (reused if present) and return its folder."""
        folder = Path(root) / f"tinyllama-{self.tag}"
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            return folder
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        kwargs = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            **self.extra,
        }
        if self.layer_types is not None:
            kwargs["layer_types"] = list(self.layer_types)
            kwargs["sliding_window"] = self.sliding_window
        generator = torch.Generator().manual_seed(self.seed)
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * self.std)
        tmp = folder.with_name(folder.name + ".tmp")
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tmp.rename(folder)
        return folder

    @property
    def parameters(self) -> int:
        """Approximate parameter count (embeddings, attention, MLP, head)."""
        h, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        kv = self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
        return 2 * self.vocab_size * h + n * per_layer


#: The model of the end-to-end tests: runs in well under a second on 2 cores.
TEST_MODEL = TinyLlama()
#: A hybrid model: one sliding-window and one full-attention layer (two KV cache groups).
HYBRID_MODEL = TinyLlama(layer_types=("sliding_attention", "full_attention"), sliding_window=64)
#: Big enough that recomputing a 2k-token prompt takes over a second on 2 cores (about 210M parameters).
BENCH_MODEL = TinyLlama(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=32,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    std=0.05,
)
