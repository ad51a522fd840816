"""``kvhal bench chat``'s workload: the configurations, the model, the users' conversations and the
sizes of the caches that hold them."""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from kvhal.bench.e2e import DEMO_MODEL
from kvhal.testing.models import TinyLlama

#: Configuration name -> what it is (the order of a run: the floor first).
CONFIGS = {
    "floor": "vLLM, device cache for every user",
    "vllm": "vLLM alone, small device cache",
    "host": "kvhal host tier",
    "disk": "kvhal small host + disk",
    "shared": "kvhal, 2 engines, shared remote",
    "slow": "kvhal small host + a tier slower than recompute",
    "cold-vllm": "vLLM alone, no returning users",
    "cold-host": "kvhal host tier, no returning users",
}
#: The configurations that serve the cold workload (every prompt new) instead of the chat.
COLD = ("cold-vllm", "cold-host")


def cold_workload(work: dict, vocab: int, seed: int) -> dict:
    """As many users as the chat has turns, each with one turn of a context of the chat's
    lengths: nothing returns, so kvhal only stores (its overhead against vLLM alone)."""
    rng = random.Random(seed + 1)
    users = len(work["contexts"]) * len(work["turns"])
    lengths = [len(c) for c in work["contexts"]] * len(work["turns"])
    turns = [t[u] for t in work["turns"] for u in range(len(work["contexts"]))]
    return {
        **work,
        "contexts": [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths[:users]],
        "turns": [turns],
    }


#: Logprobs kept per generated token: a near tie of three tokens still shows both runs' choices.
TOP_LOGPROBS = 5


#: The engines' dtype. In bf16, logits near 30 are rounded to 0.125-0.25 nats, so exact ties
#: are common and a tenth of users' greedy outputs flipped between runs of one configuration
#: with another batch shape; float32 leaves the outputs check little to explain.
DTYPE = "float32"


BLOCK = 32


@dataclass(frozen=True)
class ChatLlama(TinyLlama):
    """A :class:`~kvhal.testing.models.TinyLlama` whose greedy choices have clear margins.

    A random Llama's logits are close to Gaussian: its two best tokens are often within a bf16
    rounding step of each other (``kvhal bench e2e``'s model, std 0.05: 80% of generated tokens
    within 0.05 nats), and KV that differs in its last bits (reused against recomputed, or
    computed in a batch of another shape) flips them. Here every row of ``lm_head`` is scaled
    by ``exp(N(0, head_spread))`` (over the median), and the whole head so that the largest
    logit of a probe prompt is ``max_logit``: a few tokens' logits spread wider, and the best
    one stands out. The weights' std sets how far the layers carry such last bits, and how
    much the output depends on the context: the chat model (6 layers, std 0.2) gave, in
    transformers, bf16, 4 prompts x 24 greedy tokens: margins median 4.5 nats, 10th
    percentile 1.0, 2% under 0.5; the same tokens recomputed in one prefill moved logprobs by
    at most 0.13 nats and flipped 1 token of 96; changing a prompt's first 160 of 192 tokens
    changed 96-100% of its output; 24 distinct tokens of 96. (The 32-layer e2e architecture
    had no such point: at std 0.13 every output was one or two tokens repeated, at 0.2 a
    recompute moved logprobs by 0.4 nats and flipped 2 of 48.)
    """

    head_spread: float = 1.0
    max_logit: float = 30.0

    def build(self, root: Path) -> Path:
        folder = Path(root) / f"tinyllama-{self.tag}"
        if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
            return folder
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            **self.extra,
        )
        generator = torch.Generator().manual_seed(self.seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * self.std)
            spread = torch.exp(torch.randn(self.vocab_size, generator=generator) * self.head_spread)
            model.lm_head.weight.mul_((spread / spread.median())[:, None])
            model = model.to(torch.bfloat16).eval()
            probe = torch.randint(1, self.vocab_size, (1, 192), generator=torch.Generator().manual_seed(99))
            largest = model(probe).logits[0, -8:].float().max(-1).values.mean().item()
            model.lm_head.weight.mul_(self.max_logit / largest)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tmp.rename(folder)
        return folder


#: The chat model: ``kvhal demo``'s architecture (13M parameters; a 2048-token prompt takes
#: about 3 s here, the e2e model's 214M about 45 s), weights with clear margins.
CHAT_MODEL = ChatLlama(**{**asdict(DEMO_MODEL), "std": 0.2, "seed": 1})


def workload(users: int, rounds: int, context: tuple[int, int], turn: int, vocab: int, seed: int) -> dict:
    """Each user's context and each round's turns (token ids; distinct per user)."""
    rng = random.Random(seed)
    lo, hi = context

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    contexts = [tokens(rng.randint(lo, hi)) for _ in range(users)]
    turns = [
        [tokens(rng.randint(max(1, turn * 4 // 5), max(1, turn * 6 // 5))) for _ in range(users)]
        for _ in range(rounds)
    ]
    # per engine (the shared configuration has two): prompts of its own, served like the workload
    warm_up = [[tokens(min(1024, hi)) for _ in range(2)] for _ in range(2)]
    drain = tokens(2 * BLOCK)
    return {"contexts": contexts, "turns": turns, "warm_up": warm_up, "drain": drain}


def kv_bytes_per_token(recipe: TinyLlama) -> int:
    """K and V, :data:`DTYPE`, every layer."""
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[DTYPE]
    return 2 * element * recipe.num_hidden_layers * recipe.num_key_value_heads * recipe.head_dim


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK) * BLOCK


def sizing(recipe: TinyLlama, work: dict, max_tokens: int, inflight: int) -> dict:
    """Device caches, host tiers and the disk tier, in tokens and bytes."""
    rounds = len(work["turns"])
    final = [
        len(c) + sum(len(t[u]) for t in work["turns"]) + rounds * max_tokens
        for u, c in enumerate(work["contexts"])
    ]
    total, longest = sum(_blocks(n) for n in final), _blocks(max(final))
    per_token = kv_bytes_per_token(recipe)
    model_len = longest + 2 * BLOCK
    # a quarter of the users, but at least the requests in flight at their longest (no preemption)
    # (+ 1 block: vLLM's null block)
    small = _blocks(max(total // 4, inflight * longest + 2 * BLOCK, model_len)) + BLOCK
    big = _blocks(total + inflight * longest + 2 * BLOCK) + BLOCK
    small_host = _blocks(max(total // 4, (inflight + 1) * longest))
    host = _blocks(total * 5 // 4)
    return {
        "conversation_tokens": total,
        "longest_conversation": longest,
        "kv_bytes_per_token": per_token,
        "small_device_tokens": small,
        "big_device_tokens": big,
        "host_tokens": host,
        "small_host_tokens": small_host,
        "disk_tokens": 2 * total,
        "max_model_len": model_len,
    }
