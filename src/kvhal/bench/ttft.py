"""The time to first token of a tier's hits, as ``kvhal bench disk`` and ``kvhal bench shared`` measure it.

Both open the same way: :data:`~kvhal.testing.models.BENCH_MODEL` built, distinct prompts
(a warm-up, ``repeats`` measured, a fresh one for the drain steps), one engine per
scenario (:func:`~kvhal.testing.scenario.run_scenario`), and the same two references:
recompute (no kvhal) and a host hit. A tier's hit is then a fresh engine with a small host
tier reading what an earlier engine wrote (:meth:`TTFTRig.populate`, :meth:`TTFTRig.hits`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from rich.progress import Progress

from kvhal.bench.counters import kvhal_counters
from kvhal.bench.e2e import SHARING_ENV, _prompt, engine_args
from kvhal.testing.models import BENCH_MODEL
from kvhal.testing.scenario import run_scenario

#: Blocks of 32 tokens (the engines' block size).
BLOCK_TOKENS = 32


def add_ttft_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a :class:`TTFTRig`: prompt length, prompts per category, the models' folder."""
    parser.add_argument("--prompt-len", type=int, default=2048, help="TTFT prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="distinct prompts per TTFT category")
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")


class TTFTRig:
    """One bench's TTFT scenarios: the model, the prompts, the engine and what they share.

    :param prompt_len: tokens of every prompt.
    :param repeats: measured prompts per category.
    :param models: where the model is built.
    :param scenarios: how many scenarios the bench runs (its progress bar's length).
    """

    def __init__(self, prompt_len: int, repeats: int, models: Path, progress: Progress, scenarios: int):
        self.prompt_len = prompt_len
        self.repeats = repeats
        self.progress = progress
        self.task = progress.add_task("TTFT: building the model", total=scenarios)
        self.model = str(BENCH_MODEL.build(models))
        rng = random.Random(0)
        prompts = [_prompt(rng, prompt_len, BENCH_MODEL.vocab_size) for _ in range(repeats + 1)]
        self.warm, self.prompts = prompts[0], prompts[1:]
        self.fresh = _prompt(rng, prompt_len, BENCH_MODEL.vocab_size)
        self.engine = {**engine_args(prompt_len), "disable_log_stats": False}  # the kvhal_* metrics
        m = BENCH_MODEL  # one block's KV: layers x 32 tokens x KV heads x (K, V) x head size x bf16
        self.block_bytes = m.num_hidden_layers * BLOCK_TOKENS * m.num_key_value_heads * 2 * m.head_dim * 2
        # Room for one prompt's promotions and the warm-up's stores, nothing more (2048 tokens: 64 blocks).
        self.small_host = (2 * (prompt_len // BLOCK_TOKENS) + 8) * self.block_bytes
        # A write below the host tier starts when a later engine step sees the host store done, and
        # one left unstarted when the process exits is lost: every writing engine ends with steps (a
        # short prompt decoding a few tokens), a pause for the writes, and one more step.
        self.drain = [
            {"op": "generate", "prompts": [self.fresh[:64]], "max_tokens": 8, "name": "drain"},
            {"op": "sleep", "seconds": 3},
            {"op": "generate", "prompts": [self.fresh[64:128]], "max_tokens": 8, "name": "drain"},
            {"op": "metrics"},
        ]

    @staticmethod
    def gen(prompt: list[int], name: str) -> dict:
        return {"op": "generate", "prompts": [prompt], "max_tokens": 1, "name": name}

    def scenario(self, label: str, kvhal: dict | None, steps: list[dict]) -> dict:
        """One engine process running ``steps``, with kvhal configured by ``kvhal`` (``None``: without)."""
        self.progress.update(self.task, description=f"TTFT: {label}")
        result = run_scenario(
            {"model": self.model, "kvhal": kvhal, "steps": steps, "engine": self.engine, "env": SHARING_ENV}
        )
        self.progress.advance(self.task)
        return result

    def recompute(self) -> dict:
        """vLLM alone: every measured prompt computed (category ``recompute``)."""
        steps = [self.gen(self.warm, "warm-up")] + [self.gen(p, "recompute") for p in self.prompts]
        return self.scenario("recompute (no kvhal)", None, steps)

    def host_hit(self) -> dict:
        """Each prompt computed, vLLM's prefix cache reset, and the prompt again (category ``host hit``)."""
        steps = [self.gen(self.warm, "warm-up"), {"op": "reset"}, self.gen(self.warm, "warm-up")]
        for p in self.prompts:
            steps += [self.gen(p, "cold"), {"op": "reset"}, self.gen(p, "host hit")]
        return self.scenario("host hit", {"cpu_bytes_to_use": 2 << 30}, steps)

    def populate(self, label: str, kvhal: dict) -> dict:
        """An engine that computes every prompt and drains its writes to the tier below."""
        return self.scenario(
            label, kvhal, [self.gen(p, "populate") for p in (self.warm, *self.prompts)] + self.drain
        )

    def hits(self, label: str, kvhal: dict, category: str) -> dict:
        """A fresh engine that finds every prompt below its host tier (category ``category``);
        the warm-up's hit counts too, after a first prompt that warms the engine."""
        steps = [{**self.gen(self.fresh, "warm-up"), "max_tokens": 8}, {"op": "sleep", "seconds": 3}]
        steps += [self.gen(self.warm, "warm-up"), *(self.gen(p, category) for p in self.prompts), *self.drain]
        return self.scenario(label, kvhal, steps)

    def done(self) -> None:
        self.progress.remove_task(self.task)

    @staticmethod
    def metrics(result: dict, tier: str | None = None) -> dict[str, float]:
        """kvhal's counters at the scenario's last ``metrics`` step, without the ``vllm:kvhal_``
        prefix: engine-wide ones by name, tier ``tier``'s by family (``tier_loaded_blocks``)."""
        found = [s for s in result["steps"] if s["op"] == "metrics"][-1]["metrics"]
        return kvhal_counters(found, tier)

    def category(self, name: str, result: dict) -> dict:
        """The row of category ``name``: TTFT median and every run, cached and loaded tokens, outputs."""
        runs = [s for s in result["steps"] if s["name"] == name]
        outputs = [s["outputs"][0] for s in runs]
        return {
            "category": name,
            "ttft_s": statistics.median(s["seconds"] for s in runs),
            "ttft_all_s": [s["seconds"] for s in runs],
            "prompt_tokens": self.prompt_len,
            "cached_tokens": statistics.median(o["num_cached_tokens"] for o in outputs),
            "kvhal_loaded_tokens": statistics.median(o["kvhal_loaded_tokens"] or 0 for o in outputs),
            "cached_tokens_all": [o["num_cached_tokens"] for o in outputs],
            "kvhal_loaded_tokens_all": [o["kvhal_loaded_tokens"] or 0 for o in outputs],
            "outputs": [o["tokens"] for o in outputs],
        }

    def header(self) -> dict:
        """What every TTFT result opens with: the model and the sizes."""
        return {
            "model": {"recipe": BENCH_MODEL.tag, "parameters": BENCH_MODEL.parameters},
            "block_bytes": self.block_bytes,
            "small_host_bytes": self.small_host,
        }
